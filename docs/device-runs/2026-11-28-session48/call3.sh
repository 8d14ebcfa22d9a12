#!/usr/bin/env bash
# Session 48, call 3: the quantizers' bits again, with the activation glue's quotient as a
# reciprocal and one remainder step (call 2's per-element div_rn cost the glue 1.5-2.4x), the
# pinned session-47 case, the kernels' GPU tests, and the glue's A/B again (old, new, old, new).
#   usage (repo root, .whl and .ab_old present): bash <this file>
set -u
source tools/device_setup.sh
record_env
rm -rf /tmp/site_old && cp -r /tmp/site /tmp/site_old
cp .ab_old/triton_permute.py .ab_old/triton_fused_moe.py /tmp/site_old/moehal/kernels/
cp .ab_old/triton_glue.py /tmp/site_old/moehal_cuda/
step cast-ties 60 python3 tools/fp8_cast_ties.py
cat "$OUT/cast-ties.log"
step quant-bits 120 python3 -m pytest -q -p no:cacheprovider -rA tests/cuda/test_quant_bits.py \
  tests/cuda/test_gpu_fuzz.py -k "not test_cuda_backend_on_the_gpu"
tail -n 25 "$OUT/quant-bits.log"
step kernels 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_permute.py \
  tests/cuda/test_triton_grouped_gemm.py
tail -n 12 "$OUT/kernels.log"
args=(--shapes qwen3_30b_a3b,deepseek_v3_ep8 --quant fp8_block --tokens 128,4096 --backends cuda
      --breakdown --no-host --no-check --settle-s 0.5)
for v in old new old new; do
  site=/tmp/site; [ "$v" = old ] && site=/tmp/site_old
  echo "=== $v" >> "$OUT/ab.log"
  PYTHONPATH=$site timeout 75 python3 -m moehal.cli.main bench "${args[@]}" --out "/tmp/ab-$v-$SECONDS" >> "$OUT/ab.log" 2>&1
  echo "$v rc=$? ${SECONDS}s" | tee -a "$OUT/steps.txt"
done
tar -cf "$OUT/ab-json.tar" /tmp/ab-*.json 2>/dev/null
grep -E "^=== |_act_rows" "$OUT/ab.log" | cut -c1-200
cat "$OUT/steps.txt"
