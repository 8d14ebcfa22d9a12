#!/usr/bin/env bash
# Session 57, call 1 (one H200): benchmarks of record on session 56's final code (1acb52c), the
# first since session 49's prefill record and session 44's decode record. Sessions 50-56 changed
# validation, permute bounds and the fused MoE's top-k sum; this checks that none of it cost time.
#   1. prefill: bf16 and fp8_block at 1024-4096 tokens, three rounds, with the kernel breakdown,
#      as session 49's call 2 ran it (SGLang's wheels no longer fit beside the tree);
#   2. decode: bf16 at 1, 8, 16 and 128 tokens, two rounds, with the host-time columns, as
#      session 43's call 7 ran it, without the SGLang peer.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
export COLUMNS=220
step bench 330 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1024,2048,4096 --quant bf16,fp8_block --backends cuda --rounds 3 --no-host --goals \
  --breakdown --out "$OUT/bench"
step bench-decode 200 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda --rounds 2 --goals --out "$OUT/bench-decode"
echo "out-of-memory lines: $(cat "$OUT"/bench*.log | grep -c 'out of memory')"
python3 "$repo/tools/bench_compare.py" "$OUT/bench.json"
sed -n '/^goals:/,$p' "$OUT/bench.log"
sed -n '/^goals:/,$p' "$OUT/bench-decode.log"
cat "$OUT/steps.txt"
exit 0
