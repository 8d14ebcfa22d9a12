#!/usr/bin/env bash
# One GPU call (session 12): the portable fused MoE's paired GEMM1 (gate and up rows
# interleaved, one dot per K step). Its GPU tests beside the TMA and fused-MoE tests, an A/B
# against the canonical two-dot GEMM1 in one process (tools/paired_ab.py), and the bench of
# `cuda` vs `cuda.triton` vs SGLang with 2 s settles. At most 8 files land in $OUT.
#   usage (repo root, .whl carried): OUT=/tmp/out bash tools/device_paired_ab.sh
#   env: TOKENS (A/B, 1024,2048,4096), BENCH_TOKENS (1,16,128,1024,2048,4096)
set -u
source tools/device_setup.sh
record_env
step pytest-gpu "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/rocm/test_triton_paired_gate_up.py tests/rocm/test_triton_tma_weights.py tests/rocm/test_rocm_triton_moe.py
cd /tmp
export COLUMNS=240
step ab "${AB_LIMIT:-120}" python3 "$repo/tools/paired_ab.py" --tokens "${TOKENS:-1024,2048,4096}"
step bench "${BENCH_LIMIT:-150}" python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b \
  --tokens "${BENCH_TOKENS:-1,16,128,1024,2048,4096}" --quant bf16 --backends cuda,cuda.triton,sglang --reps 20 \
  --settle-s 2 --out "$OUT/bench"
rm -f "$OUT/bench.png"
cat "$OUT/steps.txt"
tail -n 3 "$OUT/pytest-gpu.log"
cat "$OUT/ab.log"
grep -E "│" "$OUT/bench.log" | head -30
exit 0
