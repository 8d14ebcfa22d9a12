#!/usr/bin/env bash
# Session 32, call 6: the session's final code. Conformance of the CUDA backend (its padding
# check now covers contiguous layouts), then the CUDA GPU tests and the custom-op tests.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 170 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step pytest-gpu 330 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
tail -n 3 "$OUT/conformance.log" "$OUT/pytest-gpu.log"
grep -i "padding" "$OUT/conformance-cuda.md" | head -20
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
