#!/usr/bin/env bash
# Session 41, call 2 (call 1's machine, SGLang's wheels carried): conformance of the CUDA backend
# on an H200 on the current code, then #4's decode records beside SGLang (two rounds, goals).
# The last H200 decode record is session 39's, before session 40's changes.
#   usage (repo root, all .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step conformance 260 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 6 "$OUT/conformance.log"
step bench 320 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda,sglang --rounds 2 --goals --out "$OUT/bench"
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
