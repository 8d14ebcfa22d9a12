#!/usr/bin/env bash
# One GPU call, the last of a session: GPU tests, the decode path against the masked one
# (tools/token_moe_sweep.py, whole layer only) and the benchmark of issue #4. At most 8 files.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_final.sh
set -u
source tools/device_setup.sh
record_env
step pytest-gpu "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/integrations/test_custom_op.py
step sweep 90 python3 tools/token_moe_sweep.py --tokens 1,2,4,6,8
cd /tmp
export COLUMNS=240
step bench "${BENCH_LIMIT:-280}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens "${TOKENS:-1,2,4,8,16,128,1024,4096}" --quant bf16,fp8_block --backends cuda,sglang --reps 20 --out "$OUT/bench"
cat "$OUT/sweep.log"; tail -3 "$OUT/pytest-gpu.log"; cat "$OUT/steps.txt"
