#!/usr/bin/env bash
# One GPU call: tune the FP8 masked GEMMs into the committed table (--update keeps bf16), then
# benchmark bf16 and fp8_block with the SGLang peer beside moehal. Results in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_tune_fp8_bench.sh
set -u
source tools/device_setup.sh
cd /tmp
slug=$(python3 -c "import torch; from moehal_cuda.gemm_choice import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table=/tmp/site/moehal_cuda/tuned/masked_gemm.$slug.json
t0=$SECONDS
timeout "${TUNE_LIMIT:-260}" python3 -m moehal_cuda.tuning --quant fp8_block --update --budget-s "${TUNE_BUDGET:-220}" \
  --tokens 1,4,16,64,128,256,512,1024,2048,4096 --out "$table" 2>&1 | tee "$OUT/tune-fp8.log" | grep -v "^ "
cp "$table" "$OUT/"
echo "tune done $((SECONDS - t0))s"
timeout "${BENCH_LIMIT:-290}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,128,1024,4096 --quant bf16,fp8_block --backends cuda,sglang --reps 20 --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s"
tail -75 "$OUT/bench.log"
