#!/usr/bin/env bash
# Session 39, call 3 (the same two-GPU machine): is call 2's higher eager host time this host or
# the code since session 29? Session 29's code (c86ce7c, its decode records; `git archive` of its
# packages into ab/s29, not committed) and this session's, benchmarked in turn, twice each, cuda
# rows only, on one machine.
#   usage (repo root, .whl carried, ab/s29 present): bash <this file>
set -u
source tools/device_setup.sh
record_env
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old ab/s29 || exit 1
args="--shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,8,16,128 --quant bf16 --backends cuda --rounds 1"
for r in 1 2; do
  step head-$r 150 python3 -m moehal.cli.main bench $args --out "$OUT/head-$r"
  PYTHONPATH=/tmp/site_old:/tmp/site step s29-$r 150 python3 -m moehal.cli.main bench $args --out "$OUT/s29-$r"
done
PYTHONPATH=/tmp/site_old:/tmp/site python3 -c "import moehal; print('old code from', moehal.__file__)"
rm -f "$OUT"/*.png "$OUT"/*.log
cat "$OUT/steps.txt"
