#!/usr/bin/env bash
# Session 39, call 1 (two GPUs): the whole CUDA GPU suite with the multi-device and stream-order
# tests, in one process, as session 38's call 5 ran it, with a step limit the suite fits in
# (call 5's 440 s cut its last test).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 560 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py tests/core/test_stream_order.py
tail -n 8 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
