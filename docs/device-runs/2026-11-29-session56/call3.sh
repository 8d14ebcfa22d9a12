#!/usr/bin/env bash
# Session 56, call 3 (one H200): the code after this session's fixes. Conformance's `tuned`
# family (the paths the device tables pick at the benchmark's model shapes; last run in session
# 55 on session 54's code) and, beside it on the same GPU, the GPU fuzz with a seed no session has
# drawn (71, fp8 and nvfp4 schemes) and the tests call 2 failed (one test's own fault, mended).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
(
  MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SEED=71 \
    MOEHAL_GPU_FUZZ_SCHEMES=fp8_block,fp8_block:ue8m0,fp8_tensor,nvfp4 \
    step gpu-fuzz-71 200 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
    -k test_cuda_backend_on_the_gpu
  step tests 120 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
    tests/core/test_permute.py tests/cuda/test_flashinfer_layouts.py tests/rocm/test_triton_bound_forward.py
) &
step tuned 400 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" --report "$OUT/conformance-tuned"
tail -n 4 "$OUT/tuned.log"
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
grep -c "^passed" "$OUT/gpu-fuzz-71.log"; tail -n 2 "$OUT/gpu-fuzz-71.log"
rm -f "$OUT/tuned.log"
cat "$OUT/steps.txt"
exit 0
