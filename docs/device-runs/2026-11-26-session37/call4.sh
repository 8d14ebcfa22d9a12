#!/usr/bin/env bash
# Session 37, call 4 (the same machine, warm): the README's test command on a GPU machine, less
# tests/cuda (call 2 ran it): call 3 found tests/core/test_errors.py building its layers on the
# best device (the GPU) with CPU weights, now pinned to the CPU. One line per test (-v), so a
# run cut by the time limit still shows what failed.
set -u
source tools/device_setup.sh
step pytest-rest 540 python3 -m pytest -v -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core tests/conformance tests/npu tests/rocm tests/distributed tests/integrations
grep -E "FAILED|ERROR" "$OUT/pytest-rest.log" | head -40
tail -n 3 "$OUT/pytest-rest.log"
cat "$OUT/steps.txt"
