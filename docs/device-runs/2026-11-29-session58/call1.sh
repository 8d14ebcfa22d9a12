#!/usr/bin/env bash
# Session 58, call 1 (one H200): the whole CUDA conformance suite on session 57's final code
# (984ba64). Session 57's last conformance run (--quick -k fp8) stopped at its time limit, so
# no complete verdict covered that session's load changes (quantize_weights per expert,
# to_fnuz, dense_aligned). The suite's two halves run side by side on one GPU, each with
# fresh allocations poisoned as always: every family but `tuned`, and the `tuned` family (the
# paths the device tables pick at the benchmark's model shapes).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step tuned 560 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" \
  --report "$OUT/conformance-tuned" &
step conformance 560 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" \
  --report "$OUT/conformance-cuda"
wait
tail -n 4 "$OUT/conformance.log" "$OUT/tuned.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log" "$OUT/tuned.log"
exit 0
