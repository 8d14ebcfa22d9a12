#!/usr/bin/env bash
# Session 59, call 2 (a fresh H200): CUDA conformance without its `tuned` family on this
# session's code: new Llama-4 routing cases (sigmoid top-1, renormalize off, router weight on the
# input), the heartbeat and late report folder; then GPU fuzz seed 75, which now draws grouped
# deepseek_v3 routing only with a correction bias and sigmoid at top-1 only unrenormalized.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
export MOEHAL_GPU_FUZZ_SHRINK=0
(cd /tmp && step conformance 420 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" \
  --report "$OUT/conformance-cuda")
MOEHAL_GPU_FUZZ_EXAMPLES=30 MOEHAL_GPU_FUZZ_SEED=75 step gpu-fuzz-75 150 python3 -m pytest -s -q \
  -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
tail -n 4 "$OUT/conformance.log"
grep -c "^passed" "$OUT/gpu-fuzz-75.log"; tail -n 2 "$OUT/gpu-fuzz-75.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
exit 0
