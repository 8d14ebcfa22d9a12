#!/usr/bin/env bash
# Session 42, call 1 (one H200, a fresh machine): the CUDA GPU suite on this session's fixes
# (hidden states of any column stride, the conformance suite's oracle and dtype checks, the
# custom op's copies and symbolic ids, weights refused on another GPU index), plus the portable
# Triton MoE tests, which run compiled here (the column-stride case among them).
# Carries the DeepGEMM wheels and SGLang's small dependencies.
#   usage (repo root, .whl partly carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 570 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py tests/core/test_stream_order.py \
  tests/rocm/test_rocm_triton_moe.py
tail -n 8 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
