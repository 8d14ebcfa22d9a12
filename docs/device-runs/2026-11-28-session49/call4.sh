#!/usr/bin/env bash
# Session 49, call 4 (H200): call 3's one GPU-fuzz failure (seed 10: nvfp4 through
# cuda.deepgemm_nvfp4_dequant, one token, top-1, intermediate 64, rel_l2 1.08e-1 against 0.1),
# replayed call by call with tools/fuzz_case_probe.py: each call against the oracle here, the
# oracle on the CPU and the float64 loop; then the case again with seeds 0..N-1.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step probe 420 python3 tools/fuzz_case_probe.py --case docs/device-runs/2026-11-28-session49/seed10-case.json \
  --out "$OUT" --seeds 48
grep -v "^ *$" "$OUT/probe.log" | grep -v Warning | head -200 | cut -c1-200 | grep -E "^[a-z ]|call" | head -120
cat "$OUT/steps.txt"
