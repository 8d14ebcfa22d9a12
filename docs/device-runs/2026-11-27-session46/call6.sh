#!/usr/bin/env bash
# Session 46, call 6 (DeepGEMM's wheels carried): the two new behaviour checks at the final code:
# kept_outputs (its second layer now loads weights of its own) and row_isolation.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step kept 240 python3 -m moehal.cli.main conformance --backend cuda --quick -k "kept_outputs/" \
  --report "$OUT/conformance-kept"
tail -n 1 "$OUT/kept.log"
step rows 240 python3 -m moehal.cli.main conformance --backend cuda --quick -k "row_isolation/" \
  --report "$OUT/conformance-rows"
tail -n 1 "$OUT/rows.log"
cat "$OUT/steps.txt"
