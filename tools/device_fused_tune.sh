#!/usr/bin/env bash
# One GPU call for the portable Triton fused MoE (`cuda.triton`, ROCm's kernel): the GPU tests
# first (session 10 moved its align step to Triton without a GPU run), then its tile tuner
# (`python -m moehal.kernels.tune_fused_moe`), the table installed into the installed package,
# and the bf16 benchmark of `cuda.triton` beside the DeepGEMM pipeline and SGLang. At most 8
# files land in $OUT.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_fused_tune.sh
#   env: SHAPES (qwen3_30b_a3b), TOKENS (1,16,128,1024,4096), TUNE_BUDGET (s per entry, 40)
set -u
source tools/device_setup.sh
record_env
step pytest-gpu "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/rocm
cd /tmp
export COLUMNS=240
slug=$(python3 -c "import torch; from moehal.hardware import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table="triton_fused_moe.$slug.json"
step tune "${TUNE_LIMIT:-260}" python3 -m moehal.kernels.tune_fused_moe --shapes "${SHAPES:-qwen3_30b_a3b}" \
  --tokens "${TOKENS:-1,16,128,1024,4096}" --quant bf16 --budget-s "${TUNE_BUDGET:-40}" --out "$OUT/$table"
[ -f "$OUT/$table" ] && cp "$OUT/$table" /tmp/site/moehal/kernels/
step bench "${BENCH_LIMIT:-120}" python3 "$repo/tools/sglang_peer.py" bench --shapes "${SHAPES:-qwen3_30b_a3b}" \
  --tokens "${TOKENS:-1,16,128,1024,4096}" --quant bf16 --backends cuda,cuda.triton,sglang --reps 20 --out "$OUT/bench"
rm -f "$OUT/bench.png"
cat "$OUT/steps.txt"
tail -n 3 "$OUT/pytest-gpu.log"
tail -n 12 "$OUT/tune.log"
grep -E "│" "$OUT/bench.log" | head -30
