#!/usr/bin/env bash
# Session 31, call 3 (H200): the FP8 fused GEMM1 on split N tiles, fused against unfused call
# after call, then whole layers A/B: the tuned GEMM1 tile adapted, and three fused tiles.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-check 150 python3 tools/fp8_fused_check.py --calls 100
step fp8-fused-ab 400 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,4,8,16 deepseek_v3_ep8:fp8_block:1,8 mixtral_8x7b:fp8_block:1,8" \
  --variants "fp8-unfused,fp8-fused,fp8-fused=16/16/128/4/4,fp8-fused=16/32/128/4/5,fp8-fused=16/64/128/4/4"
cat "$OUT/steps.txt"
