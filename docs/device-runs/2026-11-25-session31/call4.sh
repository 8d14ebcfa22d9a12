#!/usr/bin/env bash
# Session 31, call 4 (H200): the shipped default (FP8 decode fused where the table's records
# from call 3 say so) against never fused, at the recorded counts and between them; then the
# GPU tests of the changed code.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
python3 -m moehal_cuda.gemm_choice > "$OUT/table.txt" 2>&1
step fp8-shipped-ab 300 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,3,4,6,8,12,16 deepseek_v3_ep8:fp8_block:1,4,6,8 mixtral_8x7b:fp8_block:1" \
  --variants "fp8-unfused,shipped"
step pytest 240 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py tests/cuda/test_gpu.py
tail -n 5 "$OUT/pytest.log"
cat "$OUT/steps.txt"
