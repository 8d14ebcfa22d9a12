#!/usr/bin/env bash
# Session 53, call 2 (SM90): conformance's `tuned` family (every path the device tables pick at
# the benchmark's model shapes) on the same code; then 60 layers of the GPU fuzz with seed 63,
# every scheme.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tuned 300 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" --report "$OUT/conformance-tuned"
tail -n 6 "$OUT/tuned.log"
export MOEHAL_GPU_FUZZ_SHRINK=0
MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SEED=63 step gpu-fuzz-63 230 python3 -m pytest -s -q \
  -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-63.log"; tail -n 2 "$OUT/gpu-fuzz-63.log"
rm -f "$OUT/tuned.log"
cat "$OUT/steps.txt"
