#!/usr/bin/env bash
# One GPU call that gathers what the next changes are decided on: the masked GEMM tuned at
# token counts the shipped table lacks (merged into a copy of it), where a replayed step's time
# goes at decode and prefill sizes (tools/graph_trace.py), the host floor, and Qwen3 decode
# beside SGLang with the merged table. At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out TUNE_TOKENS=2,8 bash tools/device_probe.sh
set -u
source tools/device_setup.sh
record_env
export OUT
export COLUMNS=240
if [ -n "${TUNE_TOKENS:-}" ]; then
  bash tools/device_tune_rows.sh
fi
cd /tmp
for spec in ${TRACES:-qwen3_30b_a3b:8,1024,4096 deepseek_v3_ep8:1024,4096}; do  # SHAPE:TOKENS
  step "trace-${spec%%:*}" 150 python3 "$repo/tools/graph_trace.py" --shape "${spec%%:*}" --tokens "${spec#*:}" \
    --quant "${TRACE_QUANT:-bf16}"
  cat "$OUT/trace-${spec%%:*}.log" >> "$OUT/graph-trace.log" && rm -f "$OUT/trace-${spec%%:*}.log"
done
step host-floor "${HOST_LIMIT:-120}" python3 "$repo/tools/host_floor.py" --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1,16 ${HOST_PROFILE:+--profile}
step bench "${BENCH_LIMIT:-150}" python3 "$repo/tools/sglang_peer.py" bench --shapes "${BENCH_SHAPES:-qwen3_30b_a3b}" \
  --tokens "${BENCH_TOKENS:-1,2,4,8,16}" --quant bf16 --backends cuda,sglang --reps 20 --out "$OUT/bench"
rm -f "$OUT/bench.png"
cat "$OUT/steps.txt"
grep -E " us |direct" "$OUT/host-floor.log"
grep -v "^ *$" "$OUT/graph-trace.log" | head -150
grep -E "qwen3|deepseek|mixtral" "$OUT/bench.log" | grep -v skipped | head -40
exit 0
