#!/usr/bin/env bash
# Session 10's recipe for the portable Triton fused MoE (`cuda.triton`, ROCm's kernel), run as
# session 11's call 1: all of its GPU tests, then the tuner at 1-4096 tokens from no table and
# without seeds, and the bench. The steps are tools/device_triton_prefill.sh's.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_fused_tune.sh
#   env: TOKENS (1,16,128,1024,4096), TUNE_BUDGET (s per entry, 40)
TESTS="tests/cuda/test_gpu.py tests/rocm" TEST_LIMIT=${TEST_LIMIT:-200} FIRST=/nonexistent SEED=0 \
  TOKENS=${TOKENS:-1,16,128,1024,4096} TUNE_BUDGET=${TUNE_BUDGET:-40} BENCH_LIMIT=${BENCH_LIMIT:-120} \
  exec bash "$(dirname "$0")/device_triton_prefill.sh"
