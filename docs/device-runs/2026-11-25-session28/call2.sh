#!/usr/bin/env bash
# Session 28, call 2: the CUDA backend's GPU tests on the pinned sites (VERIFY on in every test:
# each pinned launch's key and kernel are checked against Triton's own choice), then the host
# A/B of call 1 again, on the code that keeps generated checks per key.
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 420 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
step host-floor 150 python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1,8
tail -n 3 "$OUT/pytest-gpu.log"
grep -E "PINNED|default\)|bound|layer:" "$OUT/host-floor.log"
cat "$OUT/steps.txt"
