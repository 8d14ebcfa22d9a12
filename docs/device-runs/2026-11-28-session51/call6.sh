#!/usr/bin/env bash
# Session 51, call 6 (H200): the NVFP4 input quantizer bound once per token count (a pinned
# launch) and the GEMM tiles kept per row count: the NVFP4 kernel tests, conformance's nvfp4
# cases, and the host time of eager decode steps beside bf16's (`moehal bench` with host columns).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_deepgemm_glue.py -k "nvfp4 or tile"
tail -n 1 "$OUT/tests.log"
step conformance 60 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
cd /tmp && export COLUMNS=220
step bench 90 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b --tokens 1,4 --quant bf16,nvfp4 --backends cuda \
  --out "$OUT/bench-host"
grep -E "qwen3" "$OUT/bench.log" | head
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
