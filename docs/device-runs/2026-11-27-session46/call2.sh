#!/usr/bin/env bash
# Session 46, call 2 (H100, call 1's machine if still warm; DeepGEMM's wheels carried): the
# `tuned` family on an H100 (session 45 ran it on an H200 only; the H100 tables declare 92
# cases), allocations poisoned as in call 1.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step tuned 540 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" --report "$OUT/conformance-tuned"
tail -n 3 "$OUT/tuned.log"
cat "$OUT/steps.txt"
