#!/usr/bin/env bash
# Session 32, call 4 (H200): the dispatch scatter alone, masked against contiguous destinations
# (call 3 traced Qwen3-30B-A3B's fp8 scatter at 72.7 us into a contiguous buffer built for 16384
# tokens): tools/scatter_probe.py at Qwen3's 4096 tokens and DeepSeek-V3's EP8 slice at 1024.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step probe-qwen3 150 python3 tools/scatter_probe.py --shape qwen3_30b_a3b --tokens 1024,4096
step probe-dsv3 120 python3 tools/scatter_probe.py --shape deepseek_v3_ep8 --tokens 1024
cat "$OUT/probe-qwen3.log" "$OUT/probe-dsv3.log" | grep -v Warn
cat "$OUT/steps.txt"
