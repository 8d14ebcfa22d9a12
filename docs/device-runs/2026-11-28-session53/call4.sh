#!/usr/bin/env bash
# Session 53, call 4 (SM90): call 3's A/B of the contiguous GEMM's device time again, in the
# order new old old new new old old new (call 3 ran old first in both rounds, and the later
# runs of a call run hotter).
#   usage (repo root, .whl and .ab_old present): bash <this file>
set -u
source tools/device_setup.sh
record_env
here=docs/device-runs/2026-11-28-session53
rm -rf /tmp/site_old && cp -r /tmp/site /tmp/site_old && cp .ab_old/triton_grouped_gemm.py /tmp/site_old/moehal/kernels/
for v in new old old new new old old new; do
  site=/tmp/site; [ "$v" = old ] && site=/tmp/site_old
  PYTHONPATH=$site timeout 60 python3 $here/contig_ab.py $v >> "$OUT/ab.log" 2>&1
done
cat "$OUT/ab.log"
