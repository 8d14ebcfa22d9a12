#!/usr/bin/env bash
# Session 33, call 6 (H200): the final code. Conformance of the CUDA backend, twice, each in
# a fresh process: call 5's run lost its CUDA context to an illegal instruction, which the
# suite now pins on the case that launched the kernel (each case synchronizes before it is
# scored) and stops at. The second run launches every kernel synchronously
# (CUDA_LAUNCH_BLOCKING=1), so a fault's traceback would name its launch.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 220 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
step conformance-blocking 260 env CUDA_LAUNCH_BLOCKING=1 python3 -m moehal.cli.main conformance --backend cuda \
  --quick --report "$OUT/conformance-cuda-blocking"
tail -n 3 "$OUT/conformance.log" "$OUT/conformance-blocking.log"
grep -B2 -A30 "context was lost" "$OUT"/conformance*.log | head -60
cat "$OUT/steps.txt"
