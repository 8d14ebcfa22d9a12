#!/usr/bin/env bash
# Session 52, call 4 (H200): session 51's call 6 again (`moehal bench` with host columns, Qwen3-30B-A3B
# at 1 and 4 tokens, bf16 and nvfp4), where an eager one-token nvfp4 step read 94 us of host
# time against bf16's 45; call 2's interleaved A/B read 62 against 68. Then the DeepGEMM glue
# tests and the GPU layer tests on this session's code.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_deepgemm_glue.py tests/cuda/test_gpu.py \
  tests/cuda/test_triton_permute.py
tail -n 1 "$OUT/tests.log"
cd /tmp && export COLUMNS=220
for r in 1 2; do
  step bench-$r 120 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --tokens 1,4,16 --quant bf16,nvfp4 \
    --backends cuda --out "$OUT/bench-host-$r"
  grep -E "qwen3" "$OUT/bench-$r.log" | head
done
cat "$OUT/steps.txt"
