#!/usr/bin/env bash
# Session 34, call 3 (H100): conformance of the CUDA backend run to the end on a fresh H100
# (session 33's call 4 ran 174 of 229 cases in its step's 190 s: kernel compilation), and the
# fp8 row at 4096 tokens that call 2's no-local step did not reach in its 60 s.
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 420 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step no-local 120 python3 tools/no_local_slots_check.py --quants fp8_block --tokens 4096,1
tail -n 3 "$OUT/conformance.log"
cat "$OUT/no-local.log" "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
