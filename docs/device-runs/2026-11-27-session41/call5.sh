#!/usr/bin/env bash
# Session 41, call 5 (call 4's machine): conformance of the CUDA backend on the same code, then
# #4's decode rows (bf16, cuda only, two rounds) to compare device times with call 2's on the
# code before this session's kernel change (the masked permute's max_m bound).
#   usage (repo root, DeepGEMM wheels present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step conformance 260 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
export COLUMNS=220
step bench 300 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda --rounds 2 --out "$OUT/bench"
python3 tools/bench_compare.py "$OUT/bench.json" | tail -n 14
cat "$OUT/steps.txt"
