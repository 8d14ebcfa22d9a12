#!/usr/bin/env bash
# Session 43, call 4 (call 3's machine): conformance of the CUDA backend on this session's code,
# then #4's decode rows (bf16, cuda only, two rounds) with this session's ceilings (streams of
# 4 GiB, the fastest read).
#   usage (repo root): bash <this file>
set -u
source tools/device_setup.sh
record_env
step conformance 260 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
export COLUMNS=220
step bench 220 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda --rounds 2 --out "$OUT/bench"
head -n 3 "$OUT/bench.log"
python3 -m moehal.cli.main goals "$OUT/bench.json" | tail -n 30
cat "$OUT/steps.txt"
