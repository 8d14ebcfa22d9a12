#!/usr/bin/env bash
# One GPU call on the glue kernels' loads of several column blocks (`ScatterTile.blocks_per_load`,
# `ActTile.blocks_per_load`): their kernel tests on the GPU, then scatter and activation tiles
# timed inside the whole layer (tools/glue_sweep.py), then where the layer's time goes with the
# current rules (`moehal bench --breakdown`). At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_glue_loads.sh
#   env: TESTS (pytest -k expression, "" skips), SWEEP_* (shapes, tokens, quant, budget), SCATTER_*,
#   ACT_* (the sweep's lists), BREAKDOWN_QUANT / BREAKDOWN_TOKENS (unset: no breakdown)
set -u
source tools/device_setup.sh
record_env
export OUT
export COLUMNS=240
if [ -n "${TESTS-several_column_blocks or column_chunks or layer_matches}" ]; then
  step pytest-gpu "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
    tests/cuda/test_triton_permute.py tests/cuda/test_deepgemm_glue.py \
    -k "${TESTS-several_column_blocks or column_chunks or layer_matches} or triton_permute"
fi
cd /tmp
step glue-sweep "${SWEEP_LIMIT:-420}" python3 "$repo/tools/glue_sweep.py" \
  --shapes "${SWEEP_SHAPES:-qwen3_30b_a3b}" --tokens "${SWEEP_TOKENS:-4096,2048}" \
  --quant "${SWEEP_QUANT:-fp8_block}" --budget-s "${SWEEP_BUDGET:-380}" \
  --scatter-blocks "${SCATTER_BLOCKS:-4,8,16}" --scatter-spans "${SCATTER_SPANS:-8}" \
  --scatter-warps "${SCATTER_WARPS:-4,8}" --scatter-loads "${SCATTER_LOADS:-2,4,8}" \
  --scatter-token-rows "${SCATTER_TOKEN_ROWS:-0}" ${SWEEP_FLAGS:-} \
  --act-rows "${ACT_ROWS:-16,32}" --act-spans "${ACT_SPANS:-512}" --act-warps "${ACT_WARPS:-4,8}" \
  --act-loads "${ACT_LOADS:-2,4}"
if [ -n "${BREAKDOWN_QUANT-}" ]; then  # e.g. BREAKDOWN_QUANT=bf16,fp8_block BREAKDOWN_TOKENS=2048,4096
  step breakdown 200 moehal bench --breakdown --shapes qwen3_30b_a3b --tokens "${BREAKDOWN_TOKENS:-2048,4096}" \
    --quant "$BREAKDOWN_QUANT" --backends cuda --max-tokens 4096 --out "$OUT/breakdown"
fi
cat "$OUT/steps.txt"
tail -3 "$OUT/pytest-gpu.log" 2>/dev/null
cat "$OUT/glue-sweep.log"
[ -f "$OUT/breakdown.log" ] && grep -E "copy|_rows|gemm" "$OUT/breakdown.log"
exit 0
