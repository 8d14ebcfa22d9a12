#!/usr/bin/env bash
# Tune the masked GEMM at the given token counts into a copy of this device's shipped table
# (`python -m moehal_cuda.tuning --update`: the table's other rows stay) and install the copy
# for the rest of the call. Bring $OUT/masked_gemm.<slug>.json back and merge its new rows
# with tools/merge_tuned.py.
#   usage (repo root, .whl carried): OUT=/tmp/out TUNE_TOKENS=2,8 [TUNE_SHAPES=a,b] bash tools/device_tune_rows.sh
set -u
source tools/device_setup.sh
record_env
slug=$(python3 -c "import torch; from moehal_cuda.gemm_choice import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table="$OUT/masked_gemm.$slug.json"
cp "backends_cuda/tuned/masked_gemm.$slug.json" "$table"
shapes=${TUNE_SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b}
step tune "${TUNE_LIMIT:-150}" python3 -m moehal_cuda.tuning --update --shapes "$shapes" \
  --tokens "$TUNE_TOKENS" --quant "${TUNE_QUANT:-bf16}" --budget-s 100 --out "$table"
step tune-fused 90 python3 -m moehal_cuda.tuning --update --fused-only --shapes "$shapes" \
  --tokens "$TUNE_TOKENS" --budget-s 60 --out "$table"
cat "$OUT/tune-fused.log" >> "$OUT/tune.log" && rm -f "$OUT/tune-fused.log"
cp "$table" /tmp/site/moehal_cuda/tuned/
grep -E "T=" "$OUT/tune.log"
