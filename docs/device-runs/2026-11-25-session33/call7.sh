#!/usr/bin/env bash
# Session 33, call 7 (H200): the final code, after the zero-slot fix. Conformance of the CUDA
# backend, then again with every launch synchronous (CUDA_LAUNCH_BLOCKING=1, as call 6's second
# run, which lost its context in the 0-token contiguous case); then the GPU tests of the fix.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 230 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
step conformance-blocking 90 env CUDA_LAUNCH_BLOCKING=1 python3 -m moehal.cli.main conformance --backend cuda \
  --quick --report "$OUT/conformance-cuda-blocking"
cd "$repo"
step pytest 60 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_deepgemm_psum.py tests/cuda/test_triton_permute.py -k "no_slots or without_tokens or contiguous or psum"
tail -n 3 "$OUT/conformance.log" "$OUT/conformance-blocking.log" "$OUT/pytest.log"
cat "$OUT/steps.txt"
rm -f "$OUT"/conformance*.log
