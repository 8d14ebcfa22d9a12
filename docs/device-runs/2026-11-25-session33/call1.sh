#!/usr/bin/env bash
# Session 33, call 1 (H200): conformance of the CUDA backend on session 32's final code (its fp8
# padding cases at the 512-wide shape had not run on a GPU), then #4's decode records beside
# SGLang (two rounds), as session 29's call 4 took them.
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
grep -i "padding" "$OUT/conformance-cuda.md" | head -30
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
