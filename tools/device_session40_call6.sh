#!/usr/bin/env bash
# Session 40, call 6 (one GPU, DeepGEMM wheels carried): call 1's alignment A/B for fp8_block at
# decode sizes (the FP8 decode path fuses GEMM1 with the activation and zeroes stale rows by max_m).
#   usage: OUT=/tmp/out bash tools/device_session40_call6.sh
set -u
source tools/device_setup.sh
record_env
step bench-ab-fp8 400 python3 tools/bench_ab.py --variants shipped,align=64 --rounds 2 \
  --cases "qwen3_30b_a3b:fp8_block:1,16,64 deepseek_v3_ep8:fp8_block:1,8,64 mixtral_8x7b:fp8_block:1,16,64"
cat "$OUT/bench-ab-fp8.log" "$OUT/steps.txt"
