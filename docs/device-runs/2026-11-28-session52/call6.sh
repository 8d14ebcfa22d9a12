#!/usr/bin/env bash
# Session 52, call 6 (H200): the rest of the CUDA backend's GPU suite on this session's code
# (call 5 ran the DeepGEMM glue and GPU layer tests, call 3 the fuzz), as session 51's call 4.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 450 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu" \
  --deselect tests/cuda/test_deepgemm_glue.py --deselect tests/cuda/test_gpu.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20 > "$OUT/tests-summary.txt"; rm -f "$OUT/tests.log"
cat "$OUT/tests-summary.txt" "$OUT/steps.txt"
