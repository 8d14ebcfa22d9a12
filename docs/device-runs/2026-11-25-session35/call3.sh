#!/usr/bin/env bash
# Session 35, call 3 (the same H200, warm): the two tests call 2 failed, after their fixes; the
# side_stream control three times.
set -u
source tools/device_setup.sh
record_env
for i in 1 2 3; do
  step side-stream-$i 120 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
    tests/conformance/test_suite.py -k "side_stream or readable"
  tail -n 1 "$OUT/side-stream-$i.log"
done
cat "$OUT/steps.txt"
