#!/usr/bin/env bash
# Session 31, call 2: the FP8 fused GEMM1 on split N tiles (programs of one 1x128 group meet
# through an arrival counter): fused against unfused, eager and replayed, call after call; the
# whole-layer A/B; then the GPU tests of the changed kernels.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-check 150 python3 tools/fp8_fused_check.py --calls 100
step fp8-fused-ab 260 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,4,8,16 deepseek_v3_ep8:fp8_block:1,8 mixtral_8x7b:fp8_block:1,8" \
  --variants "fp8-unfused,fp8-fused"
step pytest 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py -k "fp8 or fused or gemm"
tail -n 5 "$OUT/pytest.log"
cat "$OUT/steps.txt"
