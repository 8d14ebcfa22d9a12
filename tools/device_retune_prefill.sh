#!/usr/bin/env bash
# One GPU call that re-measures the bf16 prefill choices with settled clocks (session 9):
# the ceilings timed both ways (a burst as before, and after moehal.bench.SETTLE_S), the masked
# GEMM table's prefill rows (python -m moehal_cuda.tuning), merged into the installed copy of
# this device's table so that the prefill-fusion probe that follows compares against the new
# choices, and that probe's records (--json). nvidia-smi samples clocks and power throughout.
# At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_retune_prefill.sh
set -u
source tools/device_setup.sh
record_env
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 > "$OUT/clocks.csv" 2>&1 &
smi=$!
cd /tmp
step ceilings 120 python3 - <<'PY'
import torch
from moehal.bench import measure_ceilings, time_call
dev = torch.device("cuda")
n = 8192
a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
burst = time_call(lambda: a @ b, dev, reps=10, warmup_s=0.05)
print(f"matmul {n}^3 bf16, burst (50 ms warm-up, before session 9): {2 * n**3 / burst / 1e12:.0f} TFLOP/s")
c = measure_ceilings(dev)
print(f"settled (moehal.bench.measure_ceilings): copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, matmul {c.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
PY
slug=$(python3 -c "import torch; from moehal.hardware import device_slug; print(device_slug(torch.cuda.get_device_name()))")
step tune "${TUNE_LIMIT:-400}" python3 -m moehal_cuda.tuning --quant bf16 --shapes "${SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b}" \
  --tokens "${TOKENS:-512,1024,2048,4096}" --out "$OUT/tuned-bf16.json" --budget-s "${TUNE_BUDGET:-330}"
python3 "$repo/tools/merge_tuned.py" "$OUT/tuned-bf16.json" --into "/tmp/site/moehal_cuda/tuned/masked_gemm.$slug.json" > /dev/null
step probe "${PROBE_LIMIT:-200}" python3 "$repo/tools/fused_prefill_probe.py" --tiles 1 \
  --shapes "${SHAPES:-qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b}" --tokens "${TOKENS:-512,1024,2048,4096}" \
  --budget-s "${PROBE_BUDGET:-170}" --json "$OUT/probe.json" --source "$SOURCE"
kill $smi
cat "$OUT/steps.txt" "$OUT/ceilings.log"
grep -v "^ *$" "$OUT/tune.log" | tail -30
grep -v "Using default\|^ *$" "$OUT/probe.log"
exit 0
