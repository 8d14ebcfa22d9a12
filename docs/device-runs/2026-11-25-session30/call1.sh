#!/usr/bin/env bash
# Session 30, call 1 (H200): the token-major decode pair with programmatic dependent launch
# (570e8d1): the probe's A/B of its variants, then the GPU tests of the pair, the launch paths
# and the layer.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pdl-probe 270 python3 tools/pdl_probe.py --rounds 5
step pytest-pdl 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_token_moe.py tests/core/test_fast_launch.py tests/cuda/test_fast_launch.py tests/cuda/test_gpu.py \
  tests/integrations/test_custom_op.py
tail -n 3 "$OUT/pytest-pdl.log"
cat "$OUT/steps.txt"
