#!/usr/bin/env bash
# Session 45, call 4 (call 3's machine, still warm; SGLang's wheels and the small ones, starlette now too,
# carried; no DeepGEMM): call 3's benchmark for SGLang's rows alone, which call 3 skipped
# (starlette was not carried), so that the output check also covers the peer moehal's speed
# claims are measured against. Through tools/sglang_peer.py, as the records run it (plain
# `moehal bench` cannot import SGLang there: pydantic_core is missing; this call's first run hit it).
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step bench 400 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,128,1024,4096 --quant bf16 --backends sglang --max-tokens 4096 --no-host --out "$OUT/bench"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["shape"], r["quant"], r["backend"], r["tokens"], f"{r['time_us']:.1f} us", r["peer_config"], r["check"],
          f"{r['check_rel_l2']:.2e}")
print("skipped:", d["skipped"][:3])
PY
cat "$OUT/steps.txt"
