#!/usr/bin/env bash
# Session 59, call 3 (a fresh H200): the rest of this session's GPU-side checks.
# - CUDA conformance's `tuned` family (call 2 ran every other family);
# - the permute's GPU tests: bind_permute now checks a contiguous destination's rows on the host;
# - bench's new int8 ceiling (torch._int_mm at 8192^3) on one w8a8_int8 row, with --goals;
# - replay_inputs.py: does replaying one routing flatter the timed layer (review finding 6)?
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
here=$PWD/docs/device-runs/2026-11-29-session59
(cd /tmp && step tuned 300 python3 -m moehal.cli.main conformance --backend cuda -k "tuned/" \
  --report "$OUT/conformance-tuned")
step permute-tests 60 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/core/test_permute.py
(cd /tmp && step int8-bench 70 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --quant w8a8_int8,bf16 \
  --tokens 1024 --backends cuda --reps 10 --settle-s 0.5 --no-host --goals --out "$OUT/bench-int8")
(cd /tmp && step replay-inputs 130 python3 "$here/replay_inputs.py" "$OUT/replay-inputs.json")
tail -n 2 "$OUT/tuned.log"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/permute-tests.log" | tail -n 5
cat "$OUT/replay-inputs.log"
cat "$OUT/steps.txt"
rm -f "$OUT/tuned.log" "$OUT/bench-int8.png"
exit 0
