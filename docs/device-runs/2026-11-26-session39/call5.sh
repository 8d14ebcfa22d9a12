#!/usr/bin/env bash
# Session 39, call 5 (one GPU): the CUDA backend's conformance report with its new Components
# section (61d26a2): each dispatcher, experts kernel and fused forward, verified or not run with
# its own checks' reason on this GPU.
#   usage (repo root, DeepGEMM wheels carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 400 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
grep -B2 -A16 "components of" "$OUT/conformance.log" | cut -c1-220
tail -n 1 "$OUT/conformance.log"
cat "$OUT/steps.txt"
