#!/usr/bin/env bash
# Session 49, call 1 (H200, a fresh machine): the CUDA backend's whole GPU test suite on the
# final code of session 48 (three tests there never ran on a GPU: the exact-division ones of
# tests/cuda/test_quant_bits.py and the NVFP4 glue's bitwise test), the GPU fuzz left to call 2.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 540 python3 -m pytest -q -p no:cacheprovider -rA -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -n 3 "$OUT/tests.log"
grep -E "test_ieee_div|test_reciprocal_and_remainder|nvfp4" "$OUT/tests.log" | head -20
cat "$OUT/steps.txt"
