#!/usr/bin/env bash
# Session 52, call 1 (H200; session 51 call7.sh, unrun then): session 51 call 6 measured 94 us of host time for an eager one-token NVFP4
# step against bf16's 45; on the CPU (kernels stubbed) the NVFP4 path's Python is 7 us longer.
# A cProfile of eager forwards of each, to see where the rest goes (the device budget's last minutes).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step host-nvfp4 50 python3 "$repo/tools/host_profile.py" --quant nvfp4 --pipelines cuda.deepgemm_nvfp4_dequant \
  --tokens 1 --calls 300 --top 22
step host-bf16 40 python3 "$repo/tools/host_profile.py" --quant bf16 --pipelines cuda.deepgemm --tokens 1 --calls 300 --top 22
cat "$OUT"/host-*.log | head -120
cat "$OUT/steps.txt"
