#!/usr/bin/env bash
# Session 31, call 8 (H200): after the review's refactor of the fused kernel's fp8 epilogue (one
# helper stores the quantized groups for whole and split tiles): fused against unfused call after
# call, and the GPU tests of the kernel's users.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-check 120 python3 tools/fp8_fused_check.py --calls 100
step pytest 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py
tail -n 3 "$OUT/pytest.log"
cat "$OUT/steps.txt"
