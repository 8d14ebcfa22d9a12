#!/usr/bin/env bash
# Session 34, call 1 (H200): conformance of the CUDA backend with the new no_local_slots case
# (an EP rank whose batch has rows and no segments: DeepGEMM's psum ends all 0); the same at the
# bf16 and fp8 GEMMs' sizes (tools/no_local_slots_check.py); then the CUDA GPU test suite.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 200 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step no-local 60 python3 tools/no_local_slots_check.py
step pytest-gpu 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
tail -n 3 "$OUT/conformance.log" "$OUT/pytest-gpu.log"
cat "$OUT/no-local.log" "$OUT/steps.txt"
grep -h "no_local" "$OUT/conformance-cuda.md" | head
rm -f "$OUT/conformance.log"
