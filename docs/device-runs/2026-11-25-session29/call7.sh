#!/usr/bin/env bash
# Session 29, call 7 (H200): the launch paths' GPU tests on the final code (a site pinned on a
# Tensor subclass, 6364664), with the layer's GPU tests and the token-major kernels'.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-final 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_fast_launch.py tests/cuda/test_fast_launch.py tests/cuda/test_gpu.py tests/core/test_token_moe.py \
  tests/rocm/test_triton_bound_forward.py tests/integrations/test_custom_op.py
tail -n 3 "$OUT/pytest-final.log"
cat "$OUT/steps.txt"
