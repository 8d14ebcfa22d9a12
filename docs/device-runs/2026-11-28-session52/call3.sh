#!/usr/bin/env bash
# Session 52, call 3 (H200): drawn layers on this session's code. The GPU fuzz with a seed no
# session has drawn (60), every scheme, 80 layers; then 40 nvfp4 layers (seed 61), whose masked
# batches now run kept quantizer and activation launches; then the GPU layer tests.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_SHRINK=0
MOEHAL_GPU_FUZZ_EXAMPLES=80 MOEHAL_GPU_FUZZ_SEED=60 step gpu-fuzz-all 330 python3 -m pytest -s -q -p no:cacheprovider \
  tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-all.log"; tail -n 2 "$OUT/gpu-fuzz-all.log"
MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SEED=61 MOEHAL_GPU_FUZZ_SCHEMES=nvfp4 step gpu-fuzz-nvfp4 150 \
  python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-nvfp4.log"; grep -c "masked" "$OUT/gpu-fuzz-nvfp4.log"; tail -n 2 "$OUT/gpu-fuzz-nvfp4.log"
cat "$OUT/steps.txt"
