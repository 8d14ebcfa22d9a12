#!/usr/bin/env bash
# Session 51, call 1 (H200): session 50 found NVFP4 decode steps ~25 us slower than bf16's. The
# suspect, the NVFP4 quantizer walking a row's 128-column chunks in series, now gives each chunk a
# program (`triton_glue.QDQ_SPLIT_COLUMNS`). Its tests; per-kernel graph traces of one replayed
# step (bf16, NVFP4 shipped, the serial quantizer, the token-major path); an A/B as `moehal bench` times.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_deepgemm_glue.py -k "nvfp4"
tail -n 1 "$OUT/tests.log"
step trace-bf16 60 python3 tools/graph_trace.py --quant bf16 --tokens 1,4
step trace-nvfp4 60 python3 tools/graph_trace.py --quant nvfp4 --tokens 1,4
step trace-nvfp4-serial 60 python3 tools/graph_trace.py --quant nvfp4 --tokens 1,4 --variant serial-qdq
step trace-nvfp4-token 60 python3 tools/graph_trace.py --quant nvfp4 --tokens 1,4 --variant nvfp4-token-decode
cat "$OUT"/trace-*.log
cd /tmp && export COLUMNS=220
step ab-decode 150 python3 "$repo/tools/bench_ab.py" --variants shipped,serial-qdq,nvfp4-token-decode --rounds 2 \
  --cases "qwen3_30b_a3b:nvfp4:1,4 qwen3_30b_a3b:bf16:1,4"
cat "$OUT/ab-decode.log"
cat "$OUT/steps.txt"
