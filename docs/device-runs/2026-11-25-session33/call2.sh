#!/usr/bin/env bash
# Session 33, call 2 (H200): #4's prefill record on session 32's final code, by
# tools/device_prefill_record.sh (bf16, fp8_block and SGLang bf16 at 1024-4096 tokens, 3 rounds).
#   usage (repo root, .whl carried): bash <this file>
set -u
OUT=$OUT BENCH_LIMIT=560 bash tools/device_prefill_record.sh
cat "$OUT/steps.txt"
