#!/usr/bin/env bash
# Session 46, call 4 (H200, a fresh machine; DeepGEMM's wheels carried): the CUDA backend's
# conformance on the final code without the tuned cases: allocations poisoned, row_isolation
# with its clean batch after the NaN ones. The H100 ran call 3 at an earlier tree.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step conformance 480 python3 -m moehal.cli.main conformance --backend cuda --quick -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
grep "^row_isolation" "$OUT/conformance.log" | head -3
cat "$OUT/steps.txt"
