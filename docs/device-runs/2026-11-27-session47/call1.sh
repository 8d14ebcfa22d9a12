#!/usr/bin/env bash
# Session 47, call 1 (one GPU; DeepGEMM's wheels carried): the layer-level differential fuzz
# on the GPU for the `cuda` backend (tests/cuda/test_gpu_fuzz.py): drawn configurations, every
# pipeline in turn, eager calls and graph replays, each output against the reference oracle.
# Failing examples are reported as drawn (no shrinking inside the time box).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cat "$OUT/env.txt"
export MOEHAL_GPU_FUZZ_EXAMPLES=${EXAMPLES:-80} MOEHAL_GPU_FUZZ_SHRINK=0
step gpu-fuzz 540 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  --hypothesis-show-statistics
grep -c "^passed" "$OUT/gpu-fuzz.log"
tail -n 40 "$OUT/gpu-fuzz.log"
cat "$OUT/steps.txt"
