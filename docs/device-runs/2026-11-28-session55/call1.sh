#!/usr/bin/env bash
# Session 55, call 1 (one H200): the code of session 54's end (2fe7352). Conformance's `tuned`
# family (the paths the device tables pick at the benchmark's model shapes; last run in session
# 53 on session 52's code) and, beside it on the same GPU, the GPU fuzz with two seeds no session
# has drawn: 65 (every scheme) and 66 (fp8 and nvfp4 schemes).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_SHRINK=0
(
  MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SEED=65 step gpu-fuzz-65 300 python3 -m pytest -s -q \
    -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
  MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SEED=66 MOEHAL_GPU_FUZZ_SCHEMES=fp8_block,fp8_block:ue8m0,fp8_tensor,nvfp4 \
    step gpu-fuzz-66 200 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
    -k test_cuda_backend_on_the_gpu
) &
step tuned 420 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" --report "$OUT/conformance-tuned"
tail -n 6 "$OUT/tuned.log"
wait
for s in 65 66; do grep -c "^passed" "$OUT/gpu-fuzz-$s.log"; tail -n 2 "$OUT/gpu-fuzz-$s.log"; done
rm -f "$OUT/tuned.log"
cat "$OUT/steps.txt"
exit 0
