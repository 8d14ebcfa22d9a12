#!/usr/bin/env bash
# One GPU call: the benchmark of issue #4 (three shapes, 1-4096 tokens, bf16 and fp8_block,
# CUDA-graph replay) with SGLang's fused MoE as the peer in the same run. Results in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_bench.sh
set -u
source tools/device_setup.sh
record_env
cd /tmp
date -u > "$OUT/date.txt"
export COLUMNS=240  # rich tables at full width in the log
t0=$SECONDS
timeout "${BENCH_LIMIT:-540}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens "${TOKENS:-1,4,16,128,1024,4096}" --quant bf16,fp8_block --backends cuda,sglang --reps 20 --breakdown \
  --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s"
tail -60 "$OUT/bench.log"
