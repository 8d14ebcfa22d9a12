#!/usr/bin/env bash
# One GPU call: `moehal bench` over the prefill rows of Qwen3-30B-A3B and DeepSeek-V3's EP8
# slice (bf16 and fp8_block at 1024-4096 tokens, short timings), RUNS times, each in a fresh
# process on a fresh Triton cache, printing each row as it starts. Session 24 found that such
# runs broke a CUDA-graph capture in 3 of 4 tries (a garbage collection inside the capture freed
# an earlier layer's graphs, see `moehal.graphs.gc_paused`); this shows whether that holds.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_fresh_cache_bench.sh
#   env: RUNS (default 3), LIMIT (seconds per run, default 150)
set -u
source tools/device_setup.sh
record_env
cat > /tmp/rowlog.py <<'PY'
import sys
import moehal.bench as b
orig = b.bench_one
def traced(shape, cfg, quant, backend, tokens, *a, **k):
    print(f"ROW {shape} {quant.name} {tokens}", flush=True)
    return orig(shape, cfg, quant, backend, tokens, *a, **k)
b.bench_one = traced
sys.exit(b.main(sys.argv[1:]))
PY
cd /tmp
for i in $(seq "${RUNS:-3}"); do
  TRITON_CACHE_DIR=/tmp/tc_fresh_$i timeout "${LIMIT:-150}" python3 /tmp/rowlog.py --backends cuda --reps 3 \
    --settle-s 0.2 --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1024,2048,4096 --quant bf16,fp8_block \
    > "$OUT/fresh$i.log" 2>&1
  echo "fresh cache run $i: rc=$? $(grep -c '^ROW' "$OUT/fresh$i.log") rows"
  grep -E "Error" "$OUT/fresh$i.log" | head -2
done
exit 0
