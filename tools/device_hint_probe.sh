#!/usr/bin/env bash
# One GPU call on DeepGEMM's expected_m hint and on the prefill-fusion A/B: each prefill GEMM
# alone with small hints (tools/expected_m_sweep.py), then whole layers timed as the benchmark
# times them (tools/bench_ab.py). At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_hint_probe.sh
set -u
source tools/device_setup.sh
record_env
export DG_PRINT_CONFIGS=1  # DeepGEMM prints each config it picks, once (where the build supports it)
cd /tmp
for q in ${SWEEP_QUANTS:-fp8_block bf16}; do
  step "sweep-$q" "${SWEEP_LIMIT:-150}" python3 "$repo/tools/expected_m_sweep.py" --quant "$q" \
    --shapes "${SWEEP_SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b}" --tokens "${SWEEP_TOKENS:-1024,4096}" \
    --factors "${FACTORS:-1}" --hints "${HINTS:-128,64,32}"
done
step bench-ab "${AB_LIMIT:-240}" python3 "$repo/tools/bench_ab.py" --cases "${AB_CASES:-qwen3_30b_a3b:bf16:2048,4096}" \
  --variants "${AB_VARIANTS:-shipped,no-prefill-fusion}"
step bench-ab-hint "${HINT_LIMIT:-200}" python3 "$repo/tools/bench_ab.py" \
  --cases "${HINT_CASES:-qwen3_30b_a3b:fp8_block:4096 deepseek_v3_ep8:fp8_block:1024 deepseek_v3_ep8:bf16:1024}" \
  --variants "${HINT_VARIANTS:-shipped,hint=64}"
cat "$OUT/steps.txt"
for f in "$OUT"/sweep-*.log; do echo "== $f"; grep -v "^ *$" "$f" | cut -c1-330; done
cat "$OUT/bench-ab.log" "$OUT/bench-ab-hint.log" | grep -v "Using default\|^ *$" | tail -60
exit 0
