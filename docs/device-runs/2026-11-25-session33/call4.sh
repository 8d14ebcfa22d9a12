#!/usr/bin/env bash
# Session 33, call 4 (H100): the final code, with the H100 table's new fp8 decode records.
# The table as the device reads it; fused against unfused, bit for bit, at the counts that now
# fuse and between them; the table's choice against never fused (3 rounds, medians);
# conformance of the CUDA backend (its padding check now traces the main format); DeepGEMM's
# psum layout against m_indices for Mixtral-8x7B, which session 32's check did not reach.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
python3 -m moehal_cuda.gemm_choice > "$OUT/table.txt" 2>&1
step fp8-fused-check 80 python3 tools/fp8_fused_check.py --shapes qwen3_30b_a3b --tokens 1,2,3,5,6,10,12,13 --calls 50
step fp8-shipped-ab 190 python3 tools/bench_ab.py --rounds 3 \
  --cases "qwen3_30b_a3b:fp8_block:1,2,3,5,6,8,10,12,13,16" --variants "fp8-unfused,shipped"
cd /tmp
step conformance 190 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step psum-check 70 python3 tools/psum_check.py --shapes mixtral_8x7b --tokens 8,1024,4096 --calls 3
tail -n 4 "$OUT/fp8-fused-check.log"
tail -n 3 "$OUT/conformance.log"
grep -v Warn "$OUT/psum-check.log" | tail -n 12
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
