#!/usr/bin/env bash
# One GPU call for the portable Triton fused MoE at prefill (session 11): GPU tests (TESTS),
# then the tuner at 1024 and 4096 tokens (TMA weight tiles among the candidates on SM90)
# seeded with SGLang's shipped H100 config, merged into an earlier table (FIRST: the one the
# package ships), that table installed, and `cuda` vs `cuda.triton` vs SGLang benched.
# At most 8 files land in $OUT.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_triton_prefill.sh
#   env: TESTS, FIRST (no file: start empty), SEED=0 (no seed), TOKENS (1024,4096), TUNE_BUDGET (s per entry, 100)
set -u
source tools/device_setup.sh
record_env
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
step pytest-gpu "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  ${TESTS:-tests/rocm/test_triton_tma_weights.py tests/rocm/test_rocm_triton_moe.py}
cd /tmp
export COLUMNS=240
slug=$(python3 -c "import torch; from moehal.hardware import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table="triton_fused_moe.$slug.json"
first=${FIRST:-$repo/core/kernels/$table}
[ -f "$first" ] && cp "$first" "$OUT/$table"
seed=()  # SGLang's shipped config for this shape and GPU, unless SEED=0
sgl=/tmp/site/sglang/srt/layers/moe/moe_runner/triton_utils/configs/triton_3_7_1/"E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json"
[ "${SEED:-1}" = 1 ] && [ -f "$sgl" ] && seed=(--seed-config "$sgl")
step tune "${TUNE_LIMIT:-260}" python3 -m moehal.kernels.tune_fused_moe --shapes qwen3_30b_a3b \
  --tokens "${TOKENS:-1024,4096}" --quant bf16 --budget-s "${TUNE_BUDGET:-100}" "${seed[@]}" --out "$OUT/$table"
[ -f "$OUT/$table" ] && cp "$OUT/$table" /tmp/site/moehal/kernels/
step bench "${BENCH_LIMIT:-100}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b \
  --tokens "${TOKENS:-1024,4096}" --quant bf16 --backends cuda,cuda.triton,sglang --reps 20 --out "$OUT/bench"
rm -f "$OUT/bench.png"
cat "$OUT/steps.txt"
tail -n 3 "$OUT/pytest-gpu.log"
tail -n 6 "$OUT/tune.log"
grep -E "│" "$OUT/bench.log" | head -30
