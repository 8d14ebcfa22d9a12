#!/usr/bin/env bash
# Session 31, call 5 (H200): the counts call 4 found between records (DeepSeek-V3 at 2-4 tokens
# fused on the 8-token record and 5% slower; Qwen3-30B-A3B at 6 and 12), measured with every
# fused variant for the records; then conformance of the CUDA backend on this code, and the
# launch-path and custom-op GPU tests.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step fp8-fused-ab 170 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:6,12 deepseek_v3_ep8:fp8_block:2,4" \
  --variants "fp8-unfused,fp8-fused,fp8-fused=16/32/128/4/5,fp8-fused=16/64/128/4/4"
cd /tmp
step conformance 200 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step pytest 180 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_fast_launch.py tests/cuda/test_launch_memo.py tests/integrations/test_custom_op.py
tail -n 3 "$OUT/conformance.log" "$OUT/pytest.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
