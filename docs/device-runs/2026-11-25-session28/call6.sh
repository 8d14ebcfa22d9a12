#!/usr/bin/env bash
# Session 28, call 6: conformance of the CUDA backend (quick) on the final code.
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 240 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
