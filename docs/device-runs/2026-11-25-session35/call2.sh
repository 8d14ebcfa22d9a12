#!/usr/bin/env bash
# Session 35, call 2 (call 1's H200, warm): side_stream's negative control, rewritten again after
# call 1 (one of its two cases passed), then the files call 1's suite did not reach in its 330 s
# (it stopped at 97% with no failure).
set -u
source tools/device_setup.sh
record_env
for i in 1 2 3; do
  step side-stream-$i 120 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
    tests/conformance/test_suite.py -k side_stream
  tail -n 1 "$OUT/side-stream-$i.log"
done
step pytest-rest 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 3 "$OUT/pytest-rest.log"
cat "$OUT/steps.txt"
