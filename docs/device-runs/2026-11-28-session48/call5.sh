#!/usr/bin/env bash
# Session 48, call 5 (call 4's machine, the same tree): the GPU fuzz's seed 9, 100 examples.
#   usage (repo root, .whl present): bash <this file>
source tools/device_setup.sh; record_env
export MOEHAL_GPU_FUZZ_EXAMPLES=100 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=9
step gpu-fuzz-seed9 230 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-seed9.log"; grep -n "FAIL\|Falsif\|Error" "$OUT/gpu-fuzz-seed9.log" | head -5
tail -n 3 "$OUT/gpu-fuzz-seed9.log"; cat "$OUT/steps.txt"
