#!/usr/bin/env bash
# Session 32, call 3: where the contiguous layout's time goes against the masked layout's, on
# the same rows: Qwen3-30B-A3B fp8_block at 4096 tokens and DeepSeek-V3's EP8 slice bf16 at 1024,
# built for 16384 tokens (contiguous, now with the segments' ends) and for the row (masked);
# device time per kernel (`moehal bench --breakdown`).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
export COLUMNS=220
step bd-contig 150 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --tokens 4096 --quant fp8_block \
  --backends cuda --breakdown --no-host --max-tokens 16384 --out "$OUT/bd-contig"
step bd-masked 120 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --tokens 4096 --quant fp8_block \
  --backends cuda --breakdown --no-host --out "$OUT/bd-masked"
step bd-dsv3-contig 150 python3 -m moehal.cli.main bench --shapes deepseek_v3_ep8 --tokens 1024 --quant bf16 \
  --backends cuda --breakdown --no-host --max-tokens 16384 --out "$OUT/bd-dsv3-contig"
step bd-dsv3-masked 120 python3 -m moehal.cli.main bench --shapes deepseek_v3_ep8 --tokens 1024 --quant bf16 \
  --backends cuda --breakdown --no-host --out "$OUT/bd-dsv3-masked"
for f in bd-contig bd-masked bd-dsv3-contig bd-dsv3-masked; do grep -A12 -i "breakdown\|device time" "$OUT/$f.log" | head -30; done
cat "$OUT/steps.txt"
