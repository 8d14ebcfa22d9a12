#!/usr/bin/env bash
# One GPU call: tune the fused GEMM1 + activation tile of the shipped table's decode rows
# (`python -m moehal_cuda.tuning --fused-only`), install the table, then benchmark the decode
# rows before (shipped table) and after (tuned) beside SGLang's fused MoE in the same call.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_tune_fused.sh
set -u
source tools/device_setup.sh
record_env
export COLUMNS=220  # rich tables at full width in the logs
slug=$(python3 -c "import torch; from moehal_cuda.gemm_choice import device_slug; print(device_slug(torch.cuda.get_device_name()))")
installed=/tmp/site/moehal_cuda/tuned/masked_gemm.$slug.json
cp "$installed" "$OUT/masked_gemm.$slug.json"
cp "$installed" /tmp/shipped-table.json
step tune-fused "${TUNE_LIMIT:-300}" python3 -m moehal_cuda.tuning --fused-only --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,32 --budget-s "${TUNE_BUDGET:-240}" --out "$OUT/masked_gemm.$slug.json"
cd /tmp
bench() {  # bench NAME: the decode rows, cuda and the SGLang peer
  step "$1" "${BENCH_LIMIT:-150}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
    --tokens 1,4,16 --quant bf16 --backends cuda,sglang --reps 20 --breakdown --out "$OUT/$1"
  rm -f "$OUT/$1.png"
}
bench bench-shipped
cp "$OUT/masked_gemm.$slug.json" "$installed"
bench bench-fused-tuned
cat "$OUT/steps.txt"
grep -v "^  " "$OUT/tune-fused.log" | tail -20
for f in bench-shipped bench-fused-tuned; do echo "== $f"; grep -E "(qwen3|deepseek|mixtral)_" "$OUT/$f.log" | grep -v skipped | head -20; done
exit 0
