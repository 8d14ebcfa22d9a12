#!/usr/bin/env bash
# One GPU call for a device kind with no shipped table (e.g. an H200): tune the masked GEMM
# choice for bf16 and fp8_block, then the fused GEMM1 + activation tile, install the table, and
# benchmark bf16 beside SGLang's fused MoE. Everything lands in $OUT (at most 8 files).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_tune_new_gpu.sh
set -u
source tools/device_setup.sh
record_env
export COLUMNS=240
slug=$(python3 -c "import torch; from moehal_cuda.gemm_choice import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table="$OUT/masked_gemm.$slug.json"
step tune "${TUNE_LIMIT:-360}" python3 -m moehal_cuda.tuning --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,32,64,128,256,512,1024,2048,4096 --quant bf16,fp8_block --budget-s "${TUNE_BUDGET:-320}" --out "$table"
step tune-fused 90 python3 -m moehal_cuda.tuning --fused-only --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,32 --budget-s 60 --out "$table"
mkdir -p /tmp/site/moehal_cuda/tuned && cp "$table" /tmp/site/moehal_cuda/tuned/
cd /tmp
step bench "${BENCH_LIMIT:-150}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,128,1024,4096 --quant bf16 --backends cuda,sglang --reps 20 --out "$OUT/bench"
cat "$OUT/steps.txt"
grep -E "compiled|budget" "$OUT/tune.log"
grep -E "fused:" "$OUT/tune-fused.log"
exit 0
