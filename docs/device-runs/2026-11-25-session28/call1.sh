#!/usr/bin/env bash
# Session 28, call 1: pinned launch sites on a GPU. The GPU tests of the launch paths (VERIFY on:
# every pinned launch's key and kernel are checked against Triton's own choice), then the host
# time of eager forwards with sites pinned and keyed at every launch, interleaved call by call,
# and a profile of one-token forwards.   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-launch 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_fast_launch.py tests/cuda/test_fast_launch.py tests/rocm/test_triton_bound_forward.py tests/cuda/test_gpu.py
step host-floor 240 python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,8,128
step host-profile 90 python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1 --profile
tail -n 3 "$OUT/pytest-launch.log"
grep -E "PINNED|default\)|layer:" "$OUT/host-floor.log"
cat "$OUT/steps.txt"
