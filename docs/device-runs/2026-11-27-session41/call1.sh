#!/usr/bin/env bash
# Session 41, call 1 (one H200, a fresh machine): the whole CUDA GPU suite on the current code.
# Session 40 changed DeepGEMM's masked row alignment (64 -> 128), the portable Triton experts at
# top-1 with padded ids, and DeepEP's build checks, and ran the suite on an H100 only.
# Carries the DeepGEMM wheels and SGLang's small dependencies; call 2 carries the two SGLang
# wheels and relies on this machine keeping these (all eight exceed the 64 MiB carry).
#   usage (repo root, .whl partly carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 560 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py tests/core/test_stream_order.py
tail -n 8 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
