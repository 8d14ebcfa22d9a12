#!/usr/bin/env bash
# Session 30, call 4 (H200): the session's final code (the CUDA paths that run on SM90 are
# session 29's; the audit changed SM100, DeepEP, ROCm and NPU modules): conformance of the CUDA
# backend, the CUDA GPU tests, and a trace of the fp8_block decode path (Qwen3-30B-A3B, 1 and 4
# tokens), for the next session's work.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 200 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step trace-fp8 90 python3 tools/graph_trace.py --shape qwen3_30b_a3b --tokens 1,4 --quant fp8_block
step pytest-gpu 280 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
tail -n 3 "$OUT/conformance.log" "$OUT/pytest-gpu.log"
cat "$OUT/trace-fp8.log" | grep -v Warn | head -40
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
