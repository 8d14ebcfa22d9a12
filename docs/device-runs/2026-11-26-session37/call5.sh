#!/usr/bin/env bash
# Session 37, call 5 (a fresh GPU): tests/core on a GPU machine after the CPU tests that failed
# in call 4 (121 of them, in four files) were pinned to the CPU.
set -u
source tools/device_setup.sh
record_env
step pytest-core 540 python3 -m pytest -v -p no:cacheprovider -o addopts="--import-mode=importlib" tests/core
grep -E "FAILED|ERROR" "$OUT/pytest-core.log" | head -40
tail -n 3 "$OUT/pytest-core.log"
cat "$OUT/steps.txt"
