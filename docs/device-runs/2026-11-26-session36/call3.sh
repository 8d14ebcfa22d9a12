#!/usr/bin/env bash
# Session 36, call 3: why call 2 (the full GPU suite, H100) saw side_stream's negative control
# fail a numeric case (on the default stream, where the control is in order). The test alone,
# twice; its whole file; then after test_custom_op.py, which ran before it in call 2. The test
# now names each result that is not what it expects.
set -u
source tools/device_setup.sh
record_env
T=tests/conformance/test_suite.py::test_experts_off_the_callers_stream_fail_the_side_stream_check
P=(python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib")
step alone-1 150 "${P[@]}" "$T"
step alone-2 150 "${P[@]}" "$T"
step file 200 "${P[@]}" tests/conformance/test_suite.py
step after-custom-op 200 "${P[@]}" tests/integrations/test_custom_op.py "$T"
for f in alone-1 alone-2 file after-custom-op; do grep -E "^E  .{0,400}|passed|failed" "$OUT/$f.log" | cut -c1-600 | head -8; done
cat "$OUT/steps.txt"
