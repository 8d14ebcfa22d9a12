#!/usr/bin/env bash
# Session 31, call 1: FP8 GEMM1 fused with the activation and GEMM2's input quantization,
# whole layers A/B against the unfused path (as `moehal bench` times a row), then the GPU tests
# of the changed kernels.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-ab 330 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,4,8,16 deepseek_v3_ep8:fp8_block:1,8 mixtral_8x7b:fp8_block:1,8" \
  --variants "fp8-unfused,fp8-fused,fp8-fused=16/128/128/8/4"
step pytest 230 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py
tail -n 5 "$OUT/pytest.log"
cat "$OUT/steps.txt"
