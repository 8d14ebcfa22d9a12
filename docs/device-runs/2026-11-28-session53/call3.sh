#!/usr/bin/env bash
# Session 53, call 3 (SM90): the contiguous Triton grouped GEMM (NVFP4 on Hopper's contiguous
# path) moves its row pointers by the tile's first row in int64. A review found that its int32
# offsets wrapped past 2^31 elements. The probe at sizes past that bound (input and output
# side), the kernel's and the NVFP4 path's GPU tests, conformance's nvfp4 cases, and an A/B of
# the GEMM's device time against the code before (.ab_old: the kernel file at HEAD).
#   usage (repo root, .whl and .ab_old present): bash <this file>
set -u
source tools/device_setup.sh
record_env
here=docs/device-runs/2026-11-28-session53
step probe 120 python3 $here/int32_probe.py 8192 64 199936 8192 64 262400 4096 28672 80000 14336 4096 160000 2048 4096 600000
cat "$OUT/probe.log"
step tests 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_grouped_gemm.py \
  tests/cuda/test_deepgemm_glue.py -k "contiguous or int32 or nvfp4 or tile"
tail -n 3 "$OUT/tests.log"
step conformance 120 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
rm -rf /tmp/site_old && cp -r /tmp/site /tmp/site_old && cp .ab_old/triton_grouped_gemm.py /tmp/site_old/moehal/kernels/
for v in old new old new; do
  site=/tmp/site; [ "$v" = old ] && site=/tmp/site_old
  PYTHONPATH=$site timeout 60 python3 $here/contig_ab.py $v >> "$OUT/ab.log" 2>&1
done
cat "$OUT/ab.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
