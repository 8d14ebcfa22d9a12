#!/usr/bin/env bash
# Session 36, call 2 (the same machine, warm): the GPU test suite, all of it, on this session's
# code (it needed more than call 1 of session 35's 330 s fresh; warm, Triton's cache is filled).
set -u
source tools/device_setup.sh
step pytest-gpu 560 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 15 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
