#!/usr/bin/env bash
# Session 52, call 5 (H200): call 4's test step ran out of its 200 s; the DeepGEMM glue tests and
# the GPU layer tests again, with room, summary lines only.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/cuda/test_deepgemm_glue.py tests/cuda/test_gpu.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20 > "$OUT/tests-summary.txt"; rm -f "$OUT/tests.log"
cat "$OUT/tests-summary.txt" "$OUT/steps.txt"
