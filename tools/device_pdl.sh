#!/usr/bin/env bash
# One GPU call: programmatic dependent launch for the decode chain (moehal.kernels.launch), its
# GPU test, then each mode's replayed decode step beside SGLang's (tools/graph_trace.py).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_pdl.sh
set -u
source tools/device_setup.sh
record_env
step pytest-gpu 240 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" tests/cuda/test_gpu.py
cd /tmp
step trace-qwen3 120 python3 "$repo/tools/graph_trace.py" --shape qwen3_30b_a3b --tokens 1,4,16 --pdl off,early,late
step trace-deepseek 90 python3 "$repo/tools/graph_trace.py" --shape deepseek_v3_ep8 --tokens 1,4 --pdl off,early,late
step trace-mixtral 90 python3 "$repo/tools/graph_trace.py" --shape mixtral_8x7b --tokens 1,4 --pdl off,early,late
tail -n 3 "$OUT/pytest-gpu.log"
grep -h "us per replay" "$OUT"/trace-*.log
cat "$OUT/steps.txt"
exit 0
