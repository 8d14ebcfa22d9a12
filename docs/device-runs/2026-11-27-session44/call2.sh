#!/usr/bin/env bash
# Session 44, call 2 (call 1's machine, SGLang's wheels carried): #4's prefill record on this
# session's code (tools/device_prefill_record.sh: bf16, fp8_block and SGLang, three rounds), whose
# SGLang rows now record which kernel config SGLang ran (`peer_config`), so the goals mark the
# cells measured against its default tiles.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
OUT="$OUT" bash tools/device_prefill_record.sh
python3 - "$OUT/bench.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("peer_config per shape:", sorted({(r["shape"], r["peer_config"]) for r in rows if r["backend"] == "sglang"}))
PY
cat "$OUT/steps.txt"
