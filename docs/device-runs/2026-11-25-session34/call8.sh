#!/usr/bin/env bash
# Session 34, call 8 (the same H200, warm): call 7's GPU test suite again, with Triton's cache
# warm (call 7's step ran out of its 330 s at about 91%, with no failure by then).
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 3 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
