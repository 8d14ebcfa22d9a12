#!/usr/bin/env bash
# Session 34, call 4 (H200): conformance of the CUDA backend with the new strided_inputs check
# (hidden_states a view of wider rows, column-major top-k), on every pipeline.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 300 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
grep -h "strided_inputs" "$OUT/conformance-cuda.md" | cut -c1-250
rm -f "$OUT/conformance.log"
