#!/usr/bin/env bash
# One GPU call for the portable Triton fused MoE at prefill (sessions 11-12): GPU tests (TESTS,
# "" for none), then the tuner (TMA weight tiles among the candidates on SM90) seeded with
# SGLang's shipped H100 config (its `_down` twin seeds GEMM2), every candidate's time traced,
# merged into an earlier table (FIRST: the one the package ships), that table installed;
# optionally power and clock per path under sustained replays, the paths taking turns
# (POWER_CASES), and `cuda` vs `cuda.triton` vs SGLang benched. At most 8 files land in $OUT.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_triton_prefill.sh
#   env: TESTS, FIRST (no file: start empty), SEED=0 (no seed), TOKENS (tuned, 1024,4096),
#        TUNE_BUDGET (s per entry, 100), BENCH_TOKENS (TOKENS), BENCH_SETTLE (s, 2),
#        POWER_CASES ("qwen3_30b_a3b:4096 ...")
set -u
source tools/device_setup.sh
record_env
if [ -n "${TESTS-x}" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  step pytest-gpu "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
    ${TESTS:-tests/rocm/test_triton_tma_weights.py tests/rocm/test_rocm_triton_moe.py}
fi
cd /tmp
export COLUMNS=240
slug=$(python3 -c "import torch; from moehal.hardware import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table="triton_fused_moe.$slug.json"
first=${FIRST:-$repo/core/kernels/$table}
[ -f "$first" ] && cp "$first" "$OUT/$table"
seed=()  # SGLang's shipped config for this shape and GPU, as SGLang picks it (this Triton's, else the newest), unless SEED=0
sgl=$(sglang_seed_config)
echo "seed config: ${sgl:-none}" >> "$OUT/env.txt"
[ "${SEED:-1}" = 1 ] && [ -n "$sgl" ] && seed=(--seed-config "$sgl")
step tune "${TUNE_LIMIT:-260}" python3 -m moehal.kernels.tune_fused_moe --shapes qwen3_30b_a3b \
  --tokens "${TOKENS:-1024,4096}" --quant bf16 --budget-s "${TUNE_BUDGET:-100}" "${seed[@]}" --out "$OUT/$table" \
  --trace "$OUT/tune-trace.jsonl"
[ -f "$OUT/$table" ] && cp "$OUT/$table" /tmp/site/moehal/kernels/
if [ -n "${POWER_CASES:-}" ]; then
  # shellcheck disable=SC2086  # POWER_CASES is a list of cases
  step power "${POWER_LIMIT:-150}" python3 "$repo/tools/power_probe.py" --no-fp8 --seconds "${POWER_SECONDS:-2}" \
    --paths cuda,cuda.triton,sglang --rounds "${POWER_ROUNDS:-2}" --cases $POWER_CASES
fi
step bench "${BENCH_LIMIT:-100}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b \
  --tokens "${BENCH_TOKENS:-${TOKENS:-1024,4096}}" --quant bf16 --backends cuda,cuda.triton,sglang --reps 20 \
  --settle-s "${BENCH_SETTLE:-2}" --out "$OUT/bench"
rm -f "$OUT/bench.png"
cat "$OUT/steps.txt"
[ -f "$OUT/pytest-gpu.log" ] && tail -n 3 "$OUT/pytest-gpu.log"
tail -n 6 "$OUT/tune.log"
[ -f "$OUT/power.log" ] && grep -v "^ *$\|Using default\|Config file\|TMA is enabled" "$OUT/power.log" | tail -20
grep -E "│" "$OUT/bench.log" | head -30
exit 0
