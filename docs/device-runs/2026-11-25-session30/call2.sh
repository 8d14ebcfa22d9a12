#!/usr/bin/env bash
# Session 30, call 2 (H200): the token-major decode kernels on FP8 block-scale weights
# (3a5bdaf + the GPU test): the A/B against the masked path, then the GPU tests.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-ab 280 python3 tools/fp8_decode_ab.py --rounds 3
step pytest-fp8 290 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_token_moe.py tests/cuda/test_deepgemm_glue.py tests/cuda/test_gpu.py tests/cuda/test_fast_launch.py
tail -n 5 "$OUT/pytest-fp8.log"
cat "$OUT/steps.txt"
