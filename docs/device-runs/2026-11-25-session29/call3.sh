#!/usr/bin/env bash
# Session 29, call 3 (H100): the whole GPU suite on this session's code (VERIFY on), then the host
# floor rows and the interleaved modes (launch.RAW_POINTERS off as one of them).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 420 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
step host-floor 120 python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,8,128
tail -n 3 "$OUT/pytest-gpu.log"
grep -E "RAW_POINTERS|default\)|as addresses|CompiledKernel|torch.empty" "$OUT/host-floor.log"
cat "$OUT/steps.txt"
