#!/usr/bin/env bash
# Session 37, call 2 (the same machine, warm): the whole GPU test suite in one process, the run
# that failed in session 36 (call 2: a broken capture left torch's stream current, and side_stream's
# negative control then saw NaN). tests/conftest.py now fails any GPU test that leaves a
# non-default stream current.
set -u
source tools/device_setup.sh
step pytest-gpu 560 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 15 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
