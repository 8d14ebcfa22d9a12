#!/usr/bin/env bash
# Session 50, call 4 (H200): the CUDA backend's whole GPU test suite on this session's code (the
# Triton grouped GEMM's new bias argument reaches every path that launches it), the GPU fuzz
# left out (calls 2 and 3 ran it).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 470 python3 -m pytest -q -p no:cacheprovider -rA -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
