#!/usr/bin/env bash
# One GPU call: #4's prefill record, as session 25 took it on an H200 and an H100. Every cell's
# bf16, fp8_block and SGLang rows run next to each other, ROUNDS times (`moehal bench --rounds`),
# so the goals pair each ratio within a round and report its median and range. SGLang is made
# importable by tools/sglang_peer.py. 81 rows: 380 s on an H200 (session 26, its first run as a
# script); session 25's calls of the same command took 6-7 minutes.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_prefill_record.sh
#   env: SHAPES, TOKENS (1024,2048,4096), ROUNDS (3), BENCH_LIMIT (540 s)
set -u
source tools/device_setup.sh
record_env
cd /tmp
export COLUMNS=220
step bench "${BENCH_LIMIT:-540}" python3 "$repo/tools/sglang_peer.py" bench \
  --shapes "${SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b}" --tokens "${TOKENS:-1024,2048,4096}" \
  --quant bf16,fp8_block --backends cuda,sglang --rounds "${ROUNDS:-3}" --no-host --goals --out "$OUT/bench"
echo "out-of-memory lines: $(grep -c 'out of memory' "$OUT/bench.log")"
python3 "$repo/tools/bench_compare.py" "$OUT/bench.json"
sed -n '/^goals:/,$p' "$OUT/bench.log"
