#!/usr/bin/env bash
# Session 48, call 2: IEEE division in the reference and in the Triton quantizers.
# 1. the GPU tests of the quantizers' bits and of the kernels that quantize;
# 2. tools/fp8_one_token_probe.py again (session 47's failure, step by step, and 48 seeds);
# 3. an A/B of the kernels' device time, the session's start (.ab_old: the three kernel files
#    at the session's first commit) against this code: `moehal bench --breakdown` of fp8 rows,
#    old, new, old, new.
#   usage (repo root, .whl and .ab_old present): bash <this file>
set -u
source tools/device_setup.sh
record_env
rm -rf /tmp/site_old && cp -r /tmp/site /tmp/site_old
cp .ab_old/triton_permute.py .ab_old/triton_fused_moe.py /tmp/site_old/moehal/kernels/
cp .ab_old/triton_glue.py /tmp/site_old/moehal_cuda/
step tests 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_quant_bits.py \
  tests/cuda/test_triton_permute.py tests/cuda/test_deepgemm_glue.py tests/cuda/test_triton_grouped_gemm.py
tail -n 8 "$OUT/tests.log"
step probe 120 python3 tools/fp8_one_token_probe.py --out "$OUT" --seeds 48
head -n 20 "$OUT/probe.log"
args=(--shapes qwen3_30b_a3b,deepseek_v3_ep8 --quant fp8_block --tokens 128,4096 --backends cuda
      --breakdown --no-host --no-check --settle-s 0.5)
for v in old new old new; do
  site=/tmp/site; [ "$v" = old ] && site=/tmp/site_old
  echo "=== $v" >> "$OUT/ab.log"
  PYTHONPATH=$site timeout 75 python3 -m moehal.cli.main bench "${args[@]}" --out "/tmp/ab-$v-$SECONDS" >> "$OUT/ab.log" 2>&1
  echo "$v rc=$? ${SECONDS}s" | tee -a "$OUT/steps.txt"
done
tar -cf "$OUT/ab-json.tar" /tmp/ab-*.json 2>/dev/null
grep -v "^\s*$" "$OUT/ab.log" | tail -n 80
cat "$OUT/steps.txt"
