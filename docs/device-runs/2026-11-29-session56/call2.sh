#!/usr/bin/env bash
# Session 56, call 2 (one H200): this session's review fixes. CUDA conformance without the
# `tuned` family (the shapes and routing families now also run at the 512-wide shape for paths
# the base shape does not reach; a fused forward's output is checked by the layer) and, beside it
# on the same GPU, the tests of the code that changed on the GPU path: the fused MoE's top-k sum
# (now bounded by the expert count) compiled, its pinned launches checked against Triton's
# choice, the plugin and DeepGEMM glue tests; then the GPU fuzz with a seed no session has drawn
# (70, every scheme).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
(
  step tests 330 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
    tests/rocm/test_triton_bound_forward.py tests/cuda/test_fast_launch.py tests/cuda/test_plugin.py \
    tests/cuda/test_deepgemm_glue.py tests/core/test_permute.py tests/core/test_errors.py \
    tests/conformance/test_feature_cases.py
  MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SEED=70 \
    step gpu-fuzz-70 150 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
    -k test_cuda_backend_on_the_gpu
) &
step conformance 500 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" --report "$OUT/conformance-cuda"
tail -n 4 "$OUT/conformance.log"
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
grep -c "^passed" "$OUT/gpu-fuzz-70.log"; tail -n 2 "$OUT/gpu-fuzz-70.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
exit 0
