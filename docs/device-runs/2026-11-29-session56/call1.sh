#!/usr/bin/env bash
# Session 56, call 1 (one H200): session 55's final code (ab1d705). The GPU suite in one call
# (session 55 ran it in two: call 2 ran out of time at 89%, call 3 ran the rest), without
# test_quant (call 3 ran it on this code) and the fuzz; beside it on the same GPU, the GPU fuzz
# with two seeds no session has drawn: 68 (every scheme) and 69 (fp8 and nvfp4 schemes).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_SHRINK=0
(
  MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SEED=68 step gpu-fuzz-68 280 python3 -m pytest -s -q \
    -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
  MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SEED=69 MOEHAL_GPU_FUZZ_SCHEMES=fp8_block,fp8_block:ue8m0,fp8_tensor,nvfp4 \
    step gpu-fuzz-69 220 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
    -k test_cuda_backend_on_the_gpu
) &
step tests 555 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/core/test_stream_order.py \
  tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu" --deselect tests/cuda/test_multi_device.py
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
for s in 68 69; do grep -c "^passed" "$OUT/gpu-fuzz-$s.log"; tail -n 2 "$OUT/gpu-fuzz-$s.log"; done
cat "$OUT/steps.txt"
exit 0
