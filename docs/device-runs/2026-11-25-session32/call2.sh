#!/usr/bin/env bash
# Session 32, call 2 (H200): DeepGEMM's contiguous GEMMs on the segments' ends (use_psum_layout).
# Layers with and without it, bit for bit, at the benchmark's shapes (built for 16384 tokens, so
# contiguous); the GPU tests of the DeepGEMM glue; then whole layers A/B (psum against m_indices),
# and the masked layout's time for the same rows (layers built for the row's tokens).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step psum-check 130 python3 tools/psum_check.py --calls 5
step pytest 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_deepgemm_glue.py tests/cuda/test_deepgemm_psum.py
step contig-ab 200 python3 tools/bench_ab.py --rounds 3 --max-tokens 16384 \
  --cases "qwen3_30b_a3b:bf16:1024,4096 qwen3_30b_a3b:fp8_block:4096 deepseek_v3_ep8:bf16:1024,4096 mixtral_8x7b:bf16:1024" \
  --variants "shipped,m-indices"
step masked-ref 60 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:bf16:1024,4096 qwen3_30b_a3b:fp8_block:4096" --variants shipped
cat "$OUT/psum-check.log" | grep -v Warn
tail -n 3 "$OUT/pytest.log"
cat "$OUT/contig-ab.log" "$OUT/masked-ref.log"
cat "$OUT/steps.txt"
