#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install moehal and the carried wheels, then
# doctor, conformance of the CUDA backend, GPU tests, and the benchmark. Everything lands
# under $OUT; each step is time-boxed so one slow step cannot take the rest down.
#   usage (from the repo root): OUT=/tmp/out bash tools/device_run.sh
set -u
source tools/device_setup.sh
cd /tmp
record_env
python3 -m moehal.cli.main doctor --json > "$OUT/doctor.json" 2>&1
step conformance-cuda "${CONF_LIMIT:-220}" python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
step bench "${BENCH_LIMIT:-170}" python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,16,128,1024,4096 --quant bf16,fp8_block --backends cuda,cuda.triton,transformers:grouped_mm \
  --reps 20 --out "$OUT/bench"
cd "$repo"
step pytest-gpu "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/rocm tests/integrations/test_custom_op.py
for f in "$OUT"/*.log; do echo "== $f"; tail -n 4 "$f"; done
cat "$OUT/steps.txt"
