#!/usr/bin/env bash
# Session 41, call 4 (one H200, a fresh machine): the whole CUDA GPU suite on this session's
# later code: the masked permute's max_m bound, the graph cache's direct try (no allocation for
# tensors no direct graph reads; top-1 strided inputs), routing ties to the lower index (a
# stable sort, captured in graphs), buffers rounded to powers of two without max_tokens.
# Carries the DeepGEMM wheels and SGLang's small dependencies (as call 1).
#   usage (repo root, .whl partly carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 560 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py tests/core/test_stream_order.py
tail -n 8 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
