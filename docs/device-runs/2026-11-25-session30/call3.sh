#!/usr/bin/env bash
# Session 30, call 3 (H200): the FP8 token-major kernels with each group quantized once as a
# row (not per dead tile row): whole layer token-major vs masked, and their tiles, Qwen3-30B-A3B
# fp8_block; the bf16 rows beside them (unchanged kernels); the token kernels' GPU tests.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step sweep-fp8 300 python3 tools/token_moe_sweep.py --shapes qwen3_30b_a3b --quant fp8_block --tokens 1,2,4,8 \
  --tiles --json "$OUT/sweep-fp8.json"
step sweep-bf16 60 python3 tools/token_moe_sweep.py --shapes qwen3_30b_a3b --tokens 1,4
step pytest-token 120 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_token_moe.py
tail -n 3 "$OUT/pytest-token.log"
cat "$OUT/steps.txt"
