#!/usr/bin/env bash
# Session 29, call 6 (H200): the GPU tests of the release fix (release_workspaces("cuda")) and of
# the decode paths' scratch, then the floor rows (with the launcher's C function beneath its
# Python wrapper, a measurement only) and a profile of a one-token Qwen3-30B-A3B forward.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-release 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/core/test_token_moe.py tests/core/test_fast_launch.py
step host-profile 120 python3 tools/host_floor.py --shapes qwen3_30b_a3b --tokens 1 --profile
tail -n 3 "$OUT/pytest-release.log"
grep -E "Triton launch|torch.empty|default\)|RAW_POINTERS" "$OUT/host-profile.log"
cat "$OUT/steps.txt"
