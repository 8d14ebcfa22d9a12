#!/usr/bin/env bash
# Session 33, call 3 (H100): the fp8 decode sweep that session 31 ran on the H200 only. Whole
# layers, fused GEMM1 + activation + quantization against unfused: the plain GEMM1 tile adapted,
# and the two fixed fused tiles that won rows on the H200, at the counts of the H200's records
# (3 rounds, medians). The fused tiles' bits are checked in call 4, with the table they make.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-ab 480 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,4,6,8,12,16 deepseek_v3_ep8:fp8_block:1,2,4,8 mixtral_8x7b:fp8_block:1,8" \
  --variants "fp8-unfused,fp8-fused,fp8-fused=16/32/128/4/5,fp8-fused=16/64/128/4/4"
cat "$OUT/steps.txt"
