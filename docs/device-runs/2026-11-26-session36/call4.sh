#!/usr/bin/env bash
# Session 36, call 4 (run inline, warm after call 3): tests/cuda, then side_stream's negative
# control, as call 2 ran them (call 3 ran the control alone, with its file, and after
# test_custom_op.py: all passed).
source tools/device_setup.sh; step after-cuda 500 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" -x tests/cuda tests/conformance/test_suite.py::test_experts_off_the_callers_stream_fail_the_side_stream_check; grep -E "^E  .{0,600}|passed|failed" "$OUT/after-cuda.log" | cut -c1-1500 | head -12; cat $OUT/steps.txt
