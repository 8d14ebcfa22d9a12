#!/usr/bin/env bash
# Session 34, call 5 (H200): conformance of the CUDA backend with the input_dtypes (int64 ids,
# bf16 router weights) and side_stream (the forward on a non-default stream) checks; then the
# side_stream check's own GPU test (experts on the default stream must fail it).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 300 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step pytest-stream 120 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/conformance/test_suite.py -k "side_stream or strided or input_dtypes"
tail -n 3 "$OUT/conformance.log" "$OUT/pytest-stream.log"
cat "$OUT/steps.txt"
grep -hE "^\| (side_stream|input_dtypes|strided_inputs)/" "$OUT/conformance-cuda.md" | cut -c1-200
rm -f "$OUT/conformance.log"
