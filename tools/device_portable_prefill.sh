#!/usr/bin/env bash
# One GPU call for the portable Triton fused MoE at prefill inside the `cuda` pipeline (session
# 13): GPU tests of the prefill range, then whole-layer measurements per shape and token count
# (tools/portable_prefill_probe.py) merged into the installed masked-GEMM table, so that the
# bench that follows runs `cuda` with the range the measurements give; `cuda` vs `cuda.triton`
# vs SGLang benched. At most 8 files land in $OUT.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_portable_prefill.sh
#   env: TESTS ("" for none), QUANT (bf16, fp8_block or fp8_tensor: tuned, probed and benched), TUNE_TOKENS
#        (retuned first; TUNE_BUDGET s each; TUNE_SHAPES, default Qwen3-30B-A3B, the only one seeded with
#        SGLang's config), CASES (probed: SHAPE:TOKENS,... ...; "" for none), BACKENDS, ROUNDS (2),
#        BENCH_SHAPES (qwen3_30b_a3b), BENCH_TOKENS, BENCH_QUANT (QUANT), BENCH_SETTLE (2), SRC
set -u
source tools/device_setup.sh
record_env
if [ -n "${TESTS-x}" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  step pytest-gpu "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
    ${TESTS:-tests/cuda/test_gpu.py -k "prefill or small_batch or deepgemm_layer"}
fi
export COLUMNS=240
quant=${QUANT:-bf16}
sgl_suffix=""
[ "$quant" = fp8_block ] && sgl_suffix=",dtype=fp8_w8a8,block_shape=[128, 128]"
[ "$quant" = fp8_tensor ] && sgl_suffix=",dtype=fp8_w8a8"
tune_shapes=${TUNE_SHAPES:-qwen3_30b_a3b}
slug=$(python3 -c "import torch; from moehal.hardware import device_slug; print(device_slug(torch.cuda.get_device_name()))")
table=/tmp/site/moehal_cuda/tuned/masked_gemm.$slug.json
if [ -n "${TUNE_TOKENS:-}" ]; then
  # retune the portable kernel's rows at these counts (Qwen3-30B-A3B), seeded with the config
  # SGLang would load on this GPU (this Triton's, else the newest), into the shipped table
  ftable=triton_fused_moe.$slug.json
  cp "$repo/core/kernels/$ftable" "$OUT/$ftable" 2>/dev/null
  sgl=""
  [ "$tune_shapes" = qwen3_30b_a3b ] && sgl=$(sglang_seed_config "$sgl_suffix")  # a Qwen3 config: seeds Qwen3 only
  echo "seed config: ${sgl:-none}" >> "$OUT/env.txt"
  seed=()
  [ -n "$sgl" ] && seed=(--seed-config "$sgl")
  (cd /tmp && step tune "${TUNE_LIMIT:-200}" python3 -m moehal.kernels.tune_fused_moe --shapes "$tune_shapes" \
    --tokens "$TUNE_TOKENS" --quant "$quant" --budget-s "${TUNE_BUDGET:-100}" "${seed[@]}" --out "$OUT/$ftable")
  [ -f "$OUT/$ftable" ] && cp "$OUT/$ftable" /tmp/site/moehal/kernels/
fi
if [ -n "${CASES-x}" ]; then
  # shellcheck disable=SC2086  # CASES is a list of SHAPE:TOKENS
  step probe "${PROBE_LIMIT:-330}" python3 tools/portable_prefill_probe.py --cases ${CASES:-qwen3_30b_a3b:128,1024} \
    --quant "$quant" --rounds "${ROUNDS:-2}" --json /tmp/portable.json --source "${SRC:-}"
fi
if [ -f /tmp/portable.json ]; then  # (the merged table comes back, with these records in it)
  python3 tools/merge_tuned.py /tmp/portable.json --into "$table" >> "$OUT/probe.log" 2>&1
  cp "$table" "$OUT/masked_gemm.$slug.json"
  python3 -m moehal_cuda.gemm_choice >> "$OUT/probe.log" 2>&1
fi
cd /tmp
step bench "${BENCH_LIMIT:-150}" python3 "$repo/tools/sglang_peer.py" bench --shapes "${BENCH_SHAPES:-qwen3_30b_a3b}" \
  --tokens "${BENCH_TOKENS:-1,16,128,256,512,1024,2048,4096}" --quant "${BENCH_QUANT:-$quant}" --backends "${BACKENDS:-cuda,cuda.triton,sglang}" \
  --reps 20 --settle-s "${BENCH_SETTLE:-2}" --out "$OUT/bench"
rm -f "$OUT/bench.png"
cat "$OUT/steps.txt"
[ -f "$OUT/pytest-gpu.log" ] && tail -n 3 "$OUT/pytest-gpu.log"
[ -f "$OUT/probe.log" ] && grep -E "T=|Error|error" "$OUT/probe.log" | tail -30
grep -m1 -E "pipeline|cuda.deepgemm" "$OUT/bench.log"
grep -E "│" "$OUT/bench.log" | head -60
exit 0
