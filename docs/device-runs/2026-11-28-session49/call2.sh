#!/usr/bin/env bash
# Session 49, call 2 (H200): #4's prefill record of the cuda backend on the final code of
# session 48 (its fp8 quantizers divide exactly), as sessions 25, 26 and 41 took it: bf16 and
# fp8_block at 1024-4096 tokens, three rounds, each cell's rows next to each other. SGLang's
# wheels no longer fit the device tool's 64 MiB beside the tree, so SGLang is not in this run;
# the bf16 path it was compared with in session 41 has not changed since.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
export COLUMNS=220
step bench 540 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1024,2048,4096 --quant bf16,fp8_block --backends cuda --rounds 3 --no-host --goals \
  --breakdown --out "$OUT/bench"
echo "out-of-memory lines: $(grep -c 'out of memory' "$OUT/bench.log")"
python3 "$repo/tools/bench_compare.py" "$OUT/bench.json"
sed -n '/^goals:/,$p' "$OUT/bench.log"
cat "$OUT/steps.txt"
