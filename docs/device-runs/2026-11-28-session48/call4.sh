#!/usr/bin/env bash
# Session 48, call 4, on the final kernels: the quantizers' bits (the blocks' test fixed) and
# the pinned session-47 case, the conformance suite without the tuned family (poisoned, as
# always), then the GPU fuzz's seed 8 (the series that drew session 47's failure), 60 examples.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step quant-bits 90 python3 -m pytest -q -p no:cacheprovider -rA tests/cuda/test_quant_bits.py \
  tests/cuda/test_gpu_fuzz.py -k "not test_cuda_backend_on_the_gpu"
tail -n 14 "$OUT/quant-bits.log"
step conformance 360 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 12 "$OUT/conformance.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=8
step gpu-fuzz-seed8 150 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-seed8.log"
tail -n 4 "$OUT/gpu-fuzz-seed8.log"
cat "$OUT/steps.txt"
