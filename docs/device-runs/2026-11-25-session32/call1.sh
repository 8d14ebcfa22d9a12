#!/usr/bin/env bash
# Session 32, call 1: contiguous layouts mark padding rows -1 (DeepGEMM's m_indices convention).
# The GPU tests of the permute and the DeepGEMM glue (real DeepGEMM contiguous GEMMs on the new
# marking), then whole layers A/B, marked against whole segments, on layers built for 16384
# tokens so that they take the contiguous layout (masked buffers over the 8 GiB budget).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/cuda/test_deepgemm_glue.py
step contig-ab 330 python3 tools/bench_ab.py --rounds 3 --max-tokens 16384 \
  --cases "qwen3_30b_a3b:fp8_block:1024,2048,4096 deepseek_v3_ep8:fp8_block:1024,4096 mixtral_8x7b:fp8_block:1024 qwen3_30b_a3b:bf16:4096" \
  --variants "shipped,whole-segments"
tail -n 3 "$OUT/pytest.log"
cat "$OUT/contig-ab.log"
cat "$OUT/steps.txt"
