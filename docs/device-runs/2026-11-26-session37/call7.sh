#!/usr/bin/env bash
# Session 37, call 7 (a fresh GPU): the CUDA backend's whole GPU suite in one process, as call 2,
# on the final code (-1 top-k ids, the CPU tests pinned to the CPU).
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 560 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 3 "$OUT/pytest-gpu.log"
grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20
cat "$OUT/steps.txt"
