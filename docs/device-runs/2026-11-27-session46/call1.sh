#!/usr/bin/env bash
# Session 46, call 1 (H100, a fresh machine; DeepGEMM's wheels carried): the CUDA backend's
# conformance with every case's allocations poisoned (`moehal_conformance.poison`, the new
# default: NaN in fresh floats, 1 in fresh integers), without the tuned cases (call 2).
# A CUDA kernel that reads memory it never wrote fails here, where the caching allocator's
# leftovers let it pass before.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step conformance 540 python3 -m moehal.cli.main conformance --backend cuda --quick -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
