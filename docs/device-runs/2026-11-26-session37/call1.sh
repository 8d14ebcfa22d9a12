#!/usr/bin/env bash
# Session 37, call 1 (a fresh GPU): conformance of the CUDA backend (quick), the first run of
# session 36's capture fix (cdb37aa: moehal.graphs.capturing hands the caller's stream back, used by
# the runner's cuda_graph check); it also fills Triton's cache for call 2.
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 480 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 25 "$OUT/conformance.log"
grep -E "fail|error" "$OUT/conformance-cuda.md" | head -30
cat "$OUT/steps.txt"
