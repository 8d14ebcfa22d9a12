#!/usr/bin/env bash
# One GPU call: Qwen3-30B-A3B decode sizes only, token-major vs masked and beside SGLang.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_decode_qwen3.sh
set -u
source tools/device_setup.sh
record_env
step sweep 60 python3 tools/token_moe_sweep.py --shapes qwen3_30b_a3b --tokens 1,2,4,8
cd /tmp; export COLUMNS=240
step bench 150 python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b --tokens 1,2,4,8 --quant bf16 --backends cuda,sglang --reps 20 --out "$OUT/bench-qwen3-decode"
cat "$OUT/sweep.log"; grep -E "qwen3_30b_a3b" "$OUT/bench.log" | grep -v "_kernel" | head -12; cat "$OUT/steps.txt"
