#!/usr/bin/env bash
# Session 43, call 5 (call 3's machine): the two test files call 3's time limit cut (it stopped
# inside tests/core/test_bench.py after 343 passed), each alone.
#   usage (repo root): bash <this file>
set -u
source tools/device_setup.sh
record_env
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib --durations=5"
step tests-bench 300 $PYT tests/core/test_bench.py
tail -n 12 "$OUT/tests-bench.log"
step tests-token-moe 150 $PYT tests/core/test_token_moe.py
tail -n 3 "$OUT/tests-token-moe.log"
cat "$OUT/steps.txt"
