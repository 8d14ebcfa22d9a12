#!/usr/bin/env bash
# Session 55, call 2 (one H200): the review fixes of this session that touch the GPU path.
# The GPU suite (graphs whose capture fails, the DeepGEMM portable runner, the custom op's
# detached inputs and fingerprinted ids, the layer's conversions and inference-only forward,
# Triton's interpret mode read from its knob) and, beside it on the same GPU, the GPU fuzz with
# a seed no session has drawn (67) over the fp8 schemes: UE8M0 scales now round up from the
# float's bits in the Triton quantizers.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
python3 -c "import triton; k = getattr(triton, 'knobs', None); print('triton.knobs.runtime.interpret:', getattr(getattr(k, 'runtime', None), 'interpret', 'absent'))" >> "$OUT/env.txt" 2>&1
(
  MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_EXAMPLES=50 MOEHAL_GPU_FUZZ_SEED=67 \
    MOEHAL_GPU_FUZZ_SCHEMES=fp8_block,fp8_block:ue8m0,fp8_tensor \
    step gpu-fuzz-67 300 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
    -k test_cuda_backend_on_the_gpu
) &
step tests 500 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/core/test_stream_order.py tests/core/test_quant.py \
  tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu" --deselect tests/cuda/test_multi_device.py
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
grep -c "^passed" "$OUT/gpu-fuzz-67.log"; tail -n 2 "$OUT/gpu-fuzz-67.log"
cat "$OUT/steps.txt"
exit 0
