#!/usr/bin/env bash
# Session 47, call 2 (the machine of call 1): the GPU layer fuzz again with other seeds, each
# a repeatable series of its own (MOEHAL_GPU_FUZZ_SEED), so the run adds examples to call 1's.
#   usage (repo root, .whl present): SEEDS="1 2" EXAMPLES=100 bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_EXAMPLES=${EXAMPLES:-100} MOEHAL_GPU_FUZZ_SHRINK=0
for s in ${SEEDS:-1 2}; do
  MOEHAL_GPU_FUZZ_SEED=$s step gpu-fuzz-seed$s 270 python3 -m pytest -s -q -p no:cacheprovider \
    tests/cuda/test_gpu_fuzz.py --hypothesis-show-statistics
  grep -c "^passed" "$OUT/gpu-fuzz-seed$s.log"
  tail -n 12 "$OUT/gpu-fuzz-seed$s.log"
done
cat "$OUT/steps.txt"
