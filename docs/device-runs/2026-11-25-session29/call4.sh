#!/usr/bin/env bash
# Session 29, call 4 (H200): conformance of the CUDA backend, then #4's decode records beside
# SGLang (two rounds) on this session's code.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 200 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step bench 330 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda,sglang --rounds 2 --goals --out "$OUT/bench"
tail -n 3 "$OUT/conformance.log"
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
