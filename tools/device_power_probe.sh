#!/usr/bin/env bash
# One GPU call: do short timings favour some kernels? The prefill-fusion probe (short bursts of
# replays) and the benchmark's timing (50 ms warm-up, then 30 samples of 10 replays) on the same
# rows, with the SM clock and power sampled every 50 ms (nvidia-smi) beside them.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_power_probe.sh
set -u
source tools/device_setup.sh
record_env
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 50 > "$OUT/clocks.csv" 2>&1 &
smi=$!
cd /tmp
mark() { echo "$(date -u +%Y/%m/%d\ %H:%M:%S.%3N) $*" >> "$OUT/marks.txt"; }
mark probe; step probe 200 python3 "$repo/tools/fused_prefill_probe.py" --tiles 1 --tokens "${PROBE_TOKENS:-2048,4096}"
mark bench-ab; step bench-ab "${AB_LIMIT:-300}" python3 "$repo/tools/bench_ab.py" --rounds 2 \
  --cases "${AB_CASES:-qwen3_30b_a3b:bf16:2048,4096 mixtral_8x7b:bf16:1024,4096}" \
  --variants "${AB_VARIANTS:-shipped,no-prefill-fusion,deepgemm-only}"
mark end
kill $smi
cat "$OUT/steps.txt" "$OUT/marks.txt"
grep -v "Using default\|^GemmDesc\|^ *$" "$OUT/probe.log" "$OUT/bench-ab.log"
python3 - "$OUT" <<'PY'
import csv, datetime as dt, statistics, sys
out = sys.argv[1]
marks = [l.split(" ", 2) for l in open(f"{out}/marks.txt").read().splitlines()]
marks = [(dt.datetime.strptime(d + " " + t, "%Y/%m/%d %H:%M:%S.%f"), name) for d, t, name in marks]
rows = []
for r in csv.reader(open(f"{out}/clocks.csv")):
    try:
        rows.append((dt.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f"), float(r[1].split()[0]), float(r[3].split()[0])))
    except (ValueError, IndexError):
        pass
for (t0, name), (t1, _) in zip(marks, marks[1:]):
    sel = [(c, p) for t, c, p in rows if t0 <= t < t1 and p > 300]  # samples under load
    if sel:
        cs, ps = [c for c, _ in sel], [p for _, p in sel]
        print(f"{name}: {len(sel)} loaded samples, SM clock median {statistics.median(cs):.0f} MHz (min {min(cs):.0f}), power median {statistics.median(ps):.0f} W (max {max(ps):.0f})")
PY
exit 0
