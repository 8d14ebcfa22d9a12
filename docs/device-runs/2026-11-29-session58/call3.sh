#!/usr/bin/env bash
# Session 58, call 3 (the same H200 as calls 1-2, still warm, its Triton cache filled): the GPU
# suite on session 57's final code (984ba64), as session 56's call 1 ran it plus the lifetime
# tests session 57 added; then GPU fuzz seed 74 (every scheme), a seed no session has drawn.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_SHRINK=0
step tests 400 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/core/test_stream_order.py tests/core/test_layer_lifetime.py \
  tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu" --deselect tests/cuda/test_multi_device.py
MOEHAL_GPU_FUZZ_EXAMPLES=30 MOEHAL_GPU_FUZZ_SEED=74 step gpu-fuzz-74 170 python3 -m pytest -s -q \
  -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
grep -c "^passed" "$OUT/gpu-fuzz-74.log"; tail -n 2 "$OUT/gpu-fuzz-74.log"
cat "$OUT/steps.txt"
exit 0
