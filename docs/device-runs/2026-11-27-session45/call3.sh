#!/usr/bin/env bash
# Session 45, call 3 (call 1's machine; SGLang's wheels carried): `moehal bench` with its new
# output check on every row, moehal's and SGLang's, at decode and prefill sizes (one round, no
# host columns: the check, not a new record).
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step bench 540 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,128,1024,4096 --quant bf16,fp8_block --backends cuda,sglang --max-tokens 4096 --no-host \
  --out "$OUT/bench"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(r["shape"], r["quant"], r["backend"], r["tokens"], f"{r['time_us']:.1f} us", r["check"], f"{r['check_rel_l2']:.2e}")
PY
cat "$OUT/steps.txt"
