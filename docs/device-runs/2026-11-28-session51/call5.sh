#!/usr/bin/env bash
# Session 51, call 5 (H200): the NVFP4 layer's times on this session's code (decode batches token-major,
# the quantizer split), beside bf16, Qwen3-30B-A3B and DeepSeek-V3's EP8 slice, 1-4096 tokens.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
# call 4's one failure: the plugin test still asserted session 50's default (decode batches masked)
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_plugin.py
tail -n 1 "$OUT/tests.log"
cd /tmp
export COLUMNS=220
step bench 300 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1,16,128,1024,2048,4096 \
  --quant bf16,nvfp4 --backends cuda --no-host --out "$OUT/bench-nvfp4"
grep -E "qwen3|deepseek" "$OUT/bench.log" | head -30
cat "$OUT/steps.txt"
