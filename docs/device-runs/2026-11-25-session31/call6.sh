#!/usr/bin/env bash
# Session 31, call 6 (H200): the final table (records of calls 3 and 5) as shipped, against
# never fused, at recorded counts and between them.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
python3 -m moehal_cuda.gemm_choice > "$OUT/table.txt" 2>&1
step fp8-shipped-ab 300 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,3,5,6,8,12,16 deepseek_v3_ep8:fp8_block:1,2,3,4,6,8 mixtral_8x7b:fp8_block:1,8" \
  --variants "fp8-unfused,shipped"
cat "$OUT/steps.txt"
