#!/usr/bin/env bash
# Session 47, call 5 (one GPU; DeepGEMM's wheels carried): conformance's new experts_60 case
# (an expert count that is not a power of two) on the CUDA backend, every path it claims.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cat "$OUT/env.txt"
step conformance-experts60 400 python3 -m moehal.cli.main conformance --backend cuda -k experts_60 \
  --report "$OUT/conformance-cuda-experts60"
tail -n 25 "$OUT/conformance-experts60.log"
cat "$OUT/steps.txt"
