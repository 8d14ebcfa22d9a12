#!/usr/bin/env bash
# Session 57, call 3 (one H200): this session's code (the memory-layout, lifetime, version-floor,
# fallback and load-memory fixes). The GPU suite (as session 56's call 1 ran it) with the
# changed tests beside it: the layer lifetime tests, the quantizers and fused MoE called
# directly, the bound combine. On the same GPU meanwhile: CUDA conformance's strided_inputs
# family (now with hidden states one element past an aligned address), then GPU fuzz seed 73
# (every scheme), a seed no session has drawn.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_SHRINK=0
(
  cd /tmp
  step conformance-strided 150 python3 -m moehal.cli.main conformance --backend cuda -k strided_inputs \
    --report "$OUT/conformance-strided"
  cd "$repo"
  MOEHAL_GPU_FUZZ_EXAMPLES=30 MOEHAL_GPU_FUZZ_SEED=73 step gpu-fuzz-73 200 python3 -m pytest -s -q \
    -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
) &
step tests 520 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/core/test_stream_order.py tests/core/test_layer_lifetime.py \
  tests/integrations/test_custom_op.py tests/rocm/test_rocm_triton_moe.py::test_hidden_states_of_any_column_stride \
  tests/rocm/test_rocm_triton_moe.py::test_fused_moe_refuses_weights_of_another_shape_than_the_ids \
  tests/rocm/test_rocm_align_and_quant.py::test_quantizers_called_directly_read_any_column_stride \
  -k "not test_cuda_backend_on_the_gpu" --deselect tests/cuda/test_multi_device.py
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
tail -n 3 "$OUT/conformance-strided.log"
grep -c "^passed" "$OUT/gpu-fuzz-73.log"; tail -n 2 "$OUT/gpu-fuzz-73.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance-strided.log"
exit 0
