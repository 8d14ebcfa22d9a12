#!/usr/bin/env bash
# Session 32, call 5 (H200): the contiguous scatter reading segment starts from the positions
# pass (3a83315): the probe of call 4 again, the permute GPU tests, then whole layers built for
# 16384 tokens (contiguous) beside layers built for the row (masked).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step probe-qwen3 100 python3 tools/scatter_probe.py --shape qwen3_30b_a3b --tokens 1024,4096
step pytest 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/cuda/test_deepgemm_psum.py
step contig 120 python3 tools/bench_ab.py --rounds 3 --max-tokens 16384 \
  --cases "qwen3_30b_a3b:fp8_block:4096 qwen3_30b_a3b:bf16:4096 deepseek_v3_ep8:bf16:1024" --variants shipped
step masked 120 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:4096 qwen3_30b_a3b:bf16:4096 deepseek_v3_ep8:bf16:1024" --variants shipped
grep -v Warn "$OUT/probe-qwen3.log"
tail -n 3 "$OUT/pytest.log"
cat "$OUT/contig.log" "$OUT/masked.log"
cat "$OUT/steps.txt"
