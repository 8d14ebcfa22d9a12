#!/usr/bin/env bash
# Session 43, call 2 (call 1's machine, SGLang's wheels carried): #4's decode record beside SGLang
# (two rounds, goals), with the read ceiling of this session (the fastest streaming read) in the run.
#   usage (repo root, sglang wheels in .whl): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
export COLUMNS=220
step bench 330 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda,sglang --rounds 2 --goals --out "$OUT/bench"
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
