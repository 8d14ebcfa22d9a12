#!/usr/bin/env bash
# Session 39, call 4 (one GPU): the CUDA backend's conformance report on this session's code (the
# last one, session 38's call 1, predates the device guard and DeepGEMM's one GPU per process).
#   usage (repo root, DeepGEMM wheels carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 400 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
