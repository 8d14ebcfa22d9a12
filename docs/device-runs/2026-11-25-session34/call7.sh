#!/usr/bin/env bash
# Session 34, call 7 (H200): the final code. Conformance of the CUDA backend (every new check),
# then the CUDA GPU test suite with the conformance and custom-op tests.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 220 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step pytest-gpu 330 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 3 "$OUT/conformance.log" "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
