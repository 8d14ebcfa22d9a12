#!/usr/bin/env bash
# Session 58, call 2 (the same H200 as call 1, still warm): CUDA conformance without its
# `tuned` family, alone on the GPU. In call 1 it shared the GPU with the `tuned` family and hit
# its 560 s limit with 189 cases not run (440 pass, 0 fail, 1 declined by then).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 570 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
exit 0
