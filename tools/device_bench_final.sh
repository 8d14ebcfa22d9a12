#!/usr/bin/env bash
# One GPU call for the record: the benchmark beside SGLang (bf16 and fp8_block, 1-4096 tokens,
# each layer built for its row's count), the decode rows again with every layer built for 4096
# tokens as an engine builds it (--max-tokens), and diagnostics (an fp8 replayed-step trace,
# the host floor with the shapes in reverse order). At most 8 files land in $OUT.
# PRETUNE="SHAPES TOKENS" first re-tunes those bf16 rows of this device's table, merged into the
# installed copy (and kept as $OUT/pretune.json), and then the diagnostics are skipped, as they
# are with PYTEST="tests/..." (GPU tests after the benchmark).
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_bench_final.sh
#   env: TOKENS, QUANT (bf16,fp8_block), BACKENDS (cuda,sglang), SETTLE (moehal's default),
#        FP8_TOKENS (a second, cuda-only fp8_block bench at these counts, for fp8 vs bf16),
#        ENGINE=0 (no --max-tokens rows), DIAG=0 (no diagnostics)
set -u
source tools/device_setup.sh
record_env
cd /tmp
export COLUMNS=240
shapes=qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b
if [ -n "${PRETUNE:-}" ]; then
  read -r pt_shapes pt_tokens <<< "$PRETUNE"
  slug=$(python3 -c "import torch; from moehal.hardware import device_slug; print(device_slug(torch.cuda.get_device_name()))")
  step pretune "${PRETUNE_LIMIT:-100}" python3 -m moehal_cuda.tuning --quant bf16 --shapes "$pt_shapes" --tokens "$pt_tokens" \
    --out "$OUT/pretune.json" --budget-s 80
  python3 "$repo/tools/merge_tuned.py" "$OUT/pretune.json" --into "/tmp/site/moehal_cuda/tuned/masked_gemm.$slug.json"
fi
settle=()
[ -n "${SETTLE:-}" ] && settle=(--settle-s "$SETTLE")
step bench "${BENCH_LIMIT:-300}" python3 "$repo/tools/sglang_peer.py" bench --shapes $shapes \
  --tokens "${TOKENS:-1,2,4,8,16,128,1024,4096}" --quant "${QUANT:-bf16,fp8_block}" --backends "${BACKENDS:-cuda,sglang}" \
  --reps 20 "${settle[@]}" --out "$OUT/bench"
if [ -n "${FP8_TOKENS:-}" ]; then
  step bench-fp8 "${FP8_LIMIT:-120}" python3 -m moehal.cli.main bench --shapes $shapes --tokens "$FP8_TOKENS" \
    --quant fp8_block --backends cuda --reps 20 "${settle[@]}" --out "$OUT/bench-fp8"
  rm -f "$OUT/bench-fp8.png"
fi
[ "${ENGINE:-1}" = 0 ] || step bench-engine "${ENGINE_LIMIT:-120}" python3 "$repo/tools/sglang_peer.py" bench --shapes $shapes \
  --tokens 1,2,4,8,16,128 --quant bf16 --backends cuda,sglang --reps 20 --max-tokens 4096 --out "$OUT/bench-engine"
rm -f "$OUT/bench-engine.png"
if [ -n "${PYTEST:-}" ]; then  # GPU tests after the benchmark (the diagnostics are skipped)
  step pytest-gpu "${TEST_LIMIT:-160}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" $repo/$PYTEST
  tail -3 "$OUT/pytest-gpu.log"
fi
if [ -n "${PRETUNE:-}${PYTEST:-}" ] || [ "${DIAG:-1}" = 0 ]; then
  cat "$OUT/steps.txt"
  grep -h -E "│" "$OUT/bench.log" "$OUT/bench-fp8.log" "$OUT/bench-engine.log" 2>/dev/null | head -120
  exit 0
fi
step diag-trace 120 python3 "$repo/tools/graph_trace.py" --shape qwen3_30b_a3b --tokens 1024,4096 --quant fp8_block
step diag-host 90 python3 "$repo/tools/host_floor.py" --shapes deepseek_v3_ep8,qwen3_30b_a3b --tokens 16,1
cat "$OUT/diag-host.log" >> "$OUT/diag-trace.log" && rm -f "$OUT/diag-host.log" && mv "$OUT/diag-trace.log" "$OUT/diagnostics.log"
cat "$OUT/steps.txt"
grep -E "│" "$OUT/bench-engine.log" | head -40
grep -v "^ *$" "$OUT/diagnostics.log" | grep -vi warn | head -60
