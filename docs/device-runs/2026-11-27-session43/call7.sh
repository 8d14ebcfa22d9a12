#!/usr/bin/env bash
# Session 43, call 7 (call 6's machine, SGLang's wheels carried): #4's decode rows beside SGLang
# (two rounds, goals) on this session's code, with its ceilings (4 GiB streams, the fastest read).
#   usage (repo root, sglang wheels in .whl): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
export COLUMNS=220
step bench 330 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda,sglang --rounds 2 --goals --out "$OUT/bench"
head -n 3 "$OUT/bench.log"
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
