#!/usr/bin/env bash
# Session 40, call 1 (one GPU, DeepGEMM wheels carried): does DeepGEMM's masked GEMM write across
# experts at max_m = 64 mod 128 (tools/masked_spill_probe.py), the CUDA conformance (quick) on
# the 128-row masked alignment, and a decode A/B of the alignment (bench_ab.py: shipped = 128,
# align=64 = before), on the shapes whose max_m it changes (1-64 and 129-192 tokens).
#   usage: OUT=/tmp/out bash tools/device_session40.sh
set -u
source tools/device_setup.sh
record_env
step spill-probe 150 python3 tools/masked_spill_probe.py --reps 5
step bench-ab 200 python3 tools/bench_ab.py --variants shipped,align=64 --rounds 2 \
  --cases "qwen3_30b_a3b:bf16:1,16,64,192 deepseek_v3_ep8:bf16:1,8,64,192 mixtral_8x7b:bf16:1,16,192"
cd /tmp
step conformance 300 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
tail -n 4 "$OUT/conformance.log"
rm -f "$OUT/conformance.log"
cat "$OUT/spill-probe.log" "$OUT/bench-ab.log" "$OUT/steps.txt"
