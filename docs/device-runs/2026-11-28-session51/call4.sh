#!/usr/bin/env bash
# Session 51, call 4 (H200): the CUDA backend's whole GPU test suite on this session's code (the
# token-major decode kernel that bf16 layers run gained the NVFP4 activation epilogue), the GPU
# fuzz left out (calls 2 and 3 ran it), plus the core token-kernel tests.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 480 python3 -m pytest -q -p no:cacheprovider -rA -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
