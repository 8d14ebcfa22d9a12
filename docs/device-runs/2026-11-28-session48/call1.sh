#!/usr/bin/env bash
# Session 48, call 1: session 47's open failure (fp8_block through cuda.triton, one token) on
# its own, poisoned, then step by step (tools/fp8_one_token_probe.py), then over 48 seeds.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pinned 240 python3 -m pytest -s -q -p no:cacheprovider -rxX tests/cuda/test_gpu_fuzz.py -k session47
tail -n 5 "$OUT/pinned.log"
step probe 300 python3 tools/fp8_one_token_probe.py --out "$OUT" --seeds 48
cat "$OUT/probe.log"
cat "$OUT/steps.txt"
