#!/usr/bin/env bash
# Session 38, call 5 (two GPUs): after call 4, DeepGEMM serves one GPU per process (the first
# DeepGEMM layer's) and declines the others with the reason. The probe again, then the whole
# CUDA GPU suite in one process on a two-GPU machine, the multi-device tests among them.
set -u
source tools/device_setup.sh
record_env
step probe 150 python3 tools/other_device_probe.py
cat "$OUT/probe.log"
step pytest-gpu 440 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py tests/core/test_stream_order.py
tail -n 8 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
