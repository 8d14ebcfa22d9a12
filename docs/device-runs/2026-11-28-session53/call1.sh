#!/usr/bin/env bash
# Session 53, call 1 (SM90): the whole CUDA conformance suite but its `tuned` family, on the code
# that sessions 49-52 changed (the last whole run was session 48's), poisoned as always; then 40
# layers of the GPU fuzz with a seed no session has drawn (62), every scheme.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step conformance 400 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 12 "$OUT/conformance.log"
export MOEHAL_GPU_FUZZ_SHRINK=0
MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SEED=62 step gpu-fuzz-62 140 python3 -m pytest -s -q \
  -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-62.log"; tail -n 2 "$OUT/gpu-fuzz-62.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
