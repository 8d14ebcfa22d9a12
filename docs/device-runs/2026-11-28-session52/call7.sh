#!/usr/bin/env bash
# Session 52, call 7 (H200): after the review, the masked NVFP4 glue takes its workspaces from
# `workspace` at bind time (the per-(E, max_m) cache was redundant). The NVFP4 kernel tests and
# conformance's nvfp4 cases again.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_deepgemm_glue.py -k "nvfp4 or tile"
tail -n 1 "$OUT/tests.log"
step conformance 150 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
