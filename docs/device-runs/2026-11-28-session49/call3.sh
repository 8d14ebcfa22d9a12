#!/usr/bin/env bash
# Session 49, call 3 (H200): conformance's `tuned` family (the cases at the benchmark's model
# shapes, through the kernels the device's tables choose there), last run in sessions 45-46,
# before the quantizers were made to divide exactly; then the GPU fuzz on a new series (seed
# 10), 60 examples. Every fresh allocation is poisoned, as in every conformance run.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tuned 300 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" --report "$OUT/conformance-tuned"
tail -n 3 "$OUT/tuned.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=10
step gpu-fuzz-seed10 200 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-seed10.log"; grep -n "FAIL\|Falsif\|Error" "$OUT/gpu-fuzz-seed10.log" | head -5
tail -n 3 "$OUT/gpu-fuzz-seed10.log"
cat "$OUT/steps.txt"
