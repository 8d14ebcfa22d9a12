#!/usr/bin/env bash
# Session 36, call 5: call 4 (tests/cuda, then side_stream's negative control) reproduced call
# 2's failure: the control's numeric cases gave NaN, as if the caller's stream were not the
# default one. tests/conftest.py now fails any test that leaves another stream current.
set -u
source tools/device_setup.sh
record_env
step after-cuda 500 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/conformance/test_suite.py::test_experts_off_the_callers_stream_fail_the_side_stream_check
grep -E "^(E  |ERROR|FAILED).{0,600}|passed|failed" "$OUT/after-cuda.log" | cut -c1-800 | head -20
cat "$OUT/steps.txt"
