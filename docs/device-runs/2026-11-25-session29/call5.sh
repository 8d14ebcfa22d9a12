#!/usr/bin/env bash
# Session 29, call 5 (H100): #4's decode records beside SGLang (two rounds) on this session's
# final code, and the GPU tests of the standard-layout combine that changed after call 3.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-combine 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/cuda/test_triton_permute.py tests/core/test_token_moe.py
step bench 330 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda,sglang --rounds 2 --goals --out "$OUT/bench"
tail -n 3 "$OUT/pytest-combine.log"
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
