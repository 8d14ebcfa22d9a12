#!/usr/bin/env bash
# Session 35, call 1 (a fresh H200): the CUDA GPU test suite on session 34's final code, first
# of all side_stream's rewritten negative control (session 34's call 8 lost its CUDA context to
# the old planted fault; the rewrite had not run on a GPU).
set -u
source tools/device_setup.sh
record_env
step side-stream 240 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/conformance/test_suite.py -k side_stream
tail -n 3 "$OUT/side-stream.log"
step pytest-gpu 330 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 3 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
