#!/usr/bin/env bash
# Session 46, call 3 (H100; DeepGEMM's wheels carried): the new row_isolation check alone
# (tokens holding NaN or Inf must change no other token's output), then the CUDA backend's whole
# conformance without the tuned cases on this code (poisoned allocations, row_isolation included).
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step rows 200 python3 -m moehal.cli.main conformance --backend cuda --quick -k row_isolation \
  --report "$OUT/conformance-rows" --show-passing
tail -n 3 "$OUT/rows.log"
step conformance 420 python3 -m moehal.cli.main conformance --backend cuda --quick -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
