#!/usr/bin/env bash
# Session 46, call 5 (DeepGEMM's wheels carried): the new kept_outputs check on the CUDA backend
# (an output keeps its bits through later forwards of its layer and of a second layer of its
# shape: the CUDA backend shares scratch between layers of a shape).
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step kept 300 python3 -m moehal.cli.main conformance --backend cuda --quick -k kept_outputs \
  --report "$OUT/conformance-kept" --show-passing
tail -n 25 "$OUT/kept.log"
cat "$OUT/steps.txt"
