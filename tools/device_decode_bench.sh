#!/usr/bin/env bash
# One GPU call: the decode path's sweep (tools/token_moe_sweep.py, with tiles), its GPU tests,
# then the benchmark of issue #4 (tools/device_bench.sh's run). At most 8 files in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_decode_bench.sh
set -u
source tools/device_setup.sh
record_env
step sweep 150 python3 tools/token_moe_sweep.py --tiles --tokens 1,2,4,6,8 --json "$OUT/sweep.json"
step pytest-token 120 python3 -m pytest -q -x -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_token_moe.py tests/cuda/test_gpu.py -k "token or small or kernels or tiles or split or graphs"
cd /tmp
export COLUMNS=240
step bench "${BENCH_LIMIT:-300}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens "${TOKENS:-1,2,4,8,16,128,1024,4096}" --quant bf16,fp8_block --backends cuda,sglang --reps 20 --out "$OUT/bench"
cat "$OUT/sweep.log"; tail -3 "$OUT/pytest-token.log"; cat "$OUT/steps.txt"
