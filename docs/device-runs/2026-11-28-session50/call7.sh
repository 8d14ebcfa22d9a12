#!/usr/bin/env bash
# Session 50, call 7 (H200): call 6 found NVFP4 decode steps ~25 us slower than bf16's on either
# path; the suspect is the NVFP4 quantizer walking a row's 128-column chunks in series in one
# program. Now one chunk per program: its bitwise tests, then call 6's A/B again.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 40 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_deepgemm_glue.py -k "nvfp4"
tail -n 1 "$OUT/tests.log"
step ab-decode 70 python3 tools/bench_ab.py --variants shipped,nvfp4-masked-decode --rounds 2 \
  --cases "qwen3_30b_a3b:nvfp4:1,4"
cat "$OUT/ab-decode.log"
cat "$OUT/steps.txt"
