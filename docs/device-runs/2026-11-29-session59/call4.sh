#!/usr/bin/env bash
# Session 59, call 4 (a fresh H200): the permute's GPU tests again (call 3 gave them 60 s, too few
# for a cold Triton cache), now including bind_permute's host-side row check; and the int8
# ceiling after its fix (second operand column-major; a rate below bf16's is no ceiling).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step permute-tests 150 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/core/test_permute.py
(cd /tmp && step int8-bench 60 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --quant w8a8_int8 \
  --tokens 1024 --backends cuda --reps 10 --settle-s 0.5 --no-host --out "$OUT/bench-int8")
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/permute-tests.log" | tail -n 5
grep -E "int8 matmul|w8a8_int8 " "$OUT/int8-bench.log"
cat "$OUT/steps.txt"
rm -f "$OUT/bench-int8.png"
exit 0
