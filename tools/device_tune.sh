#!/usr/bin/env bash
# One call on a GPU machine (the device tool): tune the masked grouped GEMMs of the CUDA
# backend (DeepGEMM vs the Triton tiles, `python -m moehal_cuda.tuning`), install the table
# into the installed package, then benchmark the bf16 layer with it. Everything lands in $OUT.
#   usage (from the repo root): OUT=/tmp/out bash tools/device_tune.sh
set -u
source tools/device_setup.sh
cd /tmp
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv > "$OUT/env.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/env.txt" 2>&1
slug=$(python3 -c "import torch; from moehal_cuda.gemm_choice import device_slug; print(device_slug(torch.cuda.get_device_name()))")
t0=$SECONDS
# a tiny smoke first: a broken tuner fails in seconds, not after minutes of compiling
timeout 120 python3 -m moehal_cuda.tuning --shapes tiny --tokens 1,16 --out "$OUT/smoke.json" --workers 4 \
  > "$OUT/tune-smoke.log" 2>&1 || { echo "smoke failed:"; tail -30 "$OUT/tune-smoke.log"; }
echo "smoke ok $((SECONDS - t0))s"
timeout "${TUNE_LIMIT:-400}" python3 -m moehal_cuda.tuning --shapes "${SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b}" \
  --tokens "${TOKENS:-1,4,16,32,64,128,256,512,1024,2048,4096}" --quant "${QUANT:-bf16}" \
  --budget-s "${TUNE_BUDGET:-330}" --out "$OUT/masked_gemm.$slug.json" 2>&1 | tee "$OUT/tune.log" | grep -v "^ "
echo "tune done $((SECONDS - t0))s"
cp "$OUT/masked_gemm.$slug.json" /tmp/site/moehal_cuda/tuned/ 2>/dev/null || { mkdir -p /tmp/site/moehal_cuda/tuned && cp "$OUT/masked_gemm.$slug.json" /tmp/site/moehal_cuda/tuned/; }
timeout "${BENCH_LIMIT:-110}" python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,128,1024,4096 --quant bf16 --backends cuda --reps 20 --out "$OUT/bench-tuned" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s"
tail -60 "$OUT/bench.log"
