#!/usr/bin/env bash
# One GPU call that decides a glue-kernel change: the permute/combine kernel tests on the GPU,
# where a replayed prefill step's time goes (tools/graph_trace.py), and scatter tile variants
# timed inside the whole layer (tools/glue_sweep.py). At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_glue_probe.sh
set -u
source tools/device_setup.sh
record_env
export OUT
export COLUMNS=240
step pytest-gpu "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  ${PYTEST:-tests/cuda/test_triton_permute.py}
cd /tmp
for q in ${TRACE_QUANTS:-bf16 fp8_block}; do
  for spec in ${TRACES:-qwen3_30b_a3b:1024,4096 deepseek_v3_ep8:1024}; do  # SHAPE:TOKENS
    step "trace-$q-${spec%%:*}" 150 python3 "$repo/tools/graph_trace.py" --shape "${spec%%:*}" \
      --tokens "${spec#*:}" --quant "$q" --max-tokens 4096
    cat "$OUT/trace-$q-${spec%%:*}.log" >> "$OUT/graph-trace.log" && rm -f "$OUT/trace-$q-${spec%%:*}.log"
  done
done
step glue-sweep "${SWEEP_LIMIT:-300}" python3 "$repo/tools/glue_sweep.py" --no-act \
  --shapes "${SWEEP_SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8}" --tokens "${SWEEP_TOKENS:-1024,4096}" \
  --quant "${SWEEP_QUANT:-fp8_block,bf16}" --budget-s "${SWEEP_BUDGET:-260}" \
  --scatter-blocks "${SCATTER_BLOCKS:-4,8,16}" --scatter-spans "${SCATTER_SPANS:-1,4,8}" --scatter-warps 4
cat "$OUT/steps.txt"
tail -3 "$OUT/pytest-gpu.log"
grep -v "^ *$" "$OUT/graph-trace.log" | grep -E "==|_rows|deep_gemm|_expert|kernels" | head -80
cat "$OUT/glue-sweep.log"
exit 0
