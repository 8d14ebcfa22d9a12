#!/usr/bin/env bash
# Session 31, call 7 (H200): the final code, after the fused FP8 GEMM1's stage rows and arrival
# counters became process-wide (shared with the token-major split combine): fused against
# unfused call after call, and the GPU tests of both kernels' users.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-check 120 python3 tools/fp8_fused_check.py --calls 100
step pytest 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py tests/core/test_token_moe.py tests/cuda/test_gpu.py
tail -n 3 "$OUT/pytest.log"
cat "$OUT/steps.txt"
