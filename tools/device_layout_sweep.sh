#!/usr/bin/env bash
# One GPU call: masked vs contiguous DeepGEMM experts at prefill sizes (tools/layout_sweep.py).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_layout_sweep.sh
set -u
source tools/device_setup.sh
record_env
step layout-bf16 300 python3 tools/layout_sweep.py --quant bf16
step layout-fp8 200 python3 tools/layout_sweep.py --quant fp8_block --shapes deepseek_v3_ep8,qwen3_30b_a3b --tokens 1024,4096
cat "$OUT"/layout-*.log; cat "$OUT/steps.txt"
