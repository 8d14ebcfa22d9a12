#!/usr/bin/env bash
# Session 40, call 5 (one GPU, DeepGEMM wheels carried): conformance's new top-1 padded_ids cases
# with the portable Triton experts' fix and without it, then the whole CUDA conformance (quick).
#   usage: OUT=/tmp/out bash tools/device_session40_call5.sh
set -u
source tools/device_setup.sh
record_env
step padded-without-fix 150 python3 tools/padded_top1_check.py --without-fix
step padded-with-fix 150 python3 tools/padded_top1_check.py
cd /tmp
step conformance 330 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
tail -n 4 "$OUT/conformance.log"
rm -f "$OUT/conformance.log"
cat "$OUT/padded-without-fix.log" "$OUT/padded-with-fix.log" "$OUT/steps.txt"
