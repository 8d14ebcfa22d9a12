#!/usr/bin/env bash
# Session 34, call 2 (the same H200, warm): tools/no_local_slots_check.py with its layers held to
# the contiguous layout (call 1's were masked: nothing checked), then the CUDA GPU test suite
# again (call 1's step ran out of time at about 96%; Triton's cache is warm now).
set -u
source tools/device_setup.sh
record_env
step no-local 60 python3 tools/no_local_slots_check.py
step pytest-gpu 400 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
tail -n 3 "$OUT/pytest-gpu.log"
cat "$OUT/no-local.log" "$OUT/steps.txt"
