#!/usr/bin/env bash
# Session 49, call 5 (H200): the NVFP4-on-Hopper experts after the fix (operands as NVFP4
# codes x block scales, exact in bf16; the global scales in the Triton grouped GEMMs' fp32
# epilogues): the kernel tests, conformance's nvfp4 cases, call 4's probe again, the GPU fuzz's
# seed 10 again (its example 31 failed in call 3), and the path's layer times.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 150 python3 -m pytest -q -p no:cacheprovider -rA -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py tests/cuda/test_quant_bits.py
grep -E "^(FAILED|ERROR)|out_scale|contiguous_rows|nvfp4" "$OUT/tests.log" | head -20; tail -n 1 "$OUT/tests.log"
step conformance 150 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 2 "$OUT/conformance.log"
step probe 90 python3 tools/fuzz_case_probe.py --case docs/device-runs/2026-11-28-session49/seed10-case.json \
  --out "$OUT" --seeds 24
grep -E "^  call|tolerance" "$OUT/probe.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=10
step gpu-fuzz-seed10 150 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-seed10.log"; tail -n 2 "$OUT/gpu-fuzz-seed10.log"
cd /tmp
export COLUMNS=220
step bench 60 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --tokens 1,128,2048 --quant nvfp4 \
  --backends cuda --no-host --out "$OUT/bench-nvfp4"
grep -E "qwen3" "$OUT/bench-nvfp4.log" | head -5
rm -f "$OUT/conformance.log" "$OUT/case.pt"
cat "$OUT/steps.txt"
