#!/usr/bin/env bash
# Session 50, call 1 (H200): session 49's call 5 again after its one fault (the untuned tile's 128 columns
# refused a 64-column GEMM): conformance's nvfp4 cases, call 4's probe, and the GPU fuzz's seed
# 10 up to and past its example 31 (40 examples); first, the pinned failing case
# (tests/cuda/test_gpu_fuzz.py::test_session49_nvfp4_one_token). This is session 49's call6.sh.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pinned 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k session49
tail -n 1 "$OUT/pinned.log"
step conformance 60 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
step probe 35 python3 tools/fuzz_case_probe.py --case docs/device-runs/2026-11-28-session49/seed10-case.json \
  --out "$OUT" --seeds 12
grep -E "^  call|tolerance" "$OUT/probe.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=10
step gpu-fuzz-seed10 70 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-seed10.log"; tail -n 2 "$OUT/gpu-fuzz-seed10.log"
rm -f "$OUT/conformance.log" "$OUT/case.pt"
cat "$OUT/steps.txt"
