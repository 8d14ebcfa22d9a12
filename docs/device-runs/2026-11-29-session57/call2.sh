#!/usr/bin/env bash
# Session 57, call 2 (one H200): is call 1's Qwen3-30B-A3B decode time (+4-5% at 8 and 16 tokens
# against every H200 record since session 39) the code or the machine? Session 52's code
# (c02b4b9: its `git archive` without docs, tests and tools, carried as old52/) and this session's (1acb52c) alternate in one
# call on one GPU, three processes each, taking turns, the same `moehal bench` rows with the kernel breakdown.
# Then GPU fuzz seed 72 (every scheme), a seed no session has drawn.
#   usage (repo root, .whl and old52/ present): bash <this file>
set -u
source tools/device_setup.sh
record_env
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site_old ./old52 || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_old .whl/*.whl || exit 1
mkdir -p /tmp/ab && cd /tmp
export COLUMNS=220
for i in 1 2 3; do
  for v in new old; do
    site=/tmp/site; [ $v = old ] && site=/tmp/site_old
    PYTHONPATH=$site step ab-$v-$i 65 python3 -m moehal.cli.main bench --shapes qwen3_30b_a3b \
      --tokens 8,16,128 --quant bf16 --backends cuda --no-host --no-check --breakdown --out /tmp/ab/$v-$i
    mv "$OUT/ab-$v-$i.log" /tmp/ab/
  done
done
python3 - <<'PY'
import json, glob, statistics as st, collections
t = collections.defaultdict(list); bd = collections.defaultdict(list)
for p in sorted(glob.glob("/tmp/ab/*.json")):
    v = p.split("/")[-1].split("-")[0]
    for r in json.load(open(p))["rows"]:
        t[(v, r["tokens"])].append(r["time_us"])
        for k, us in (r.get("breakdown") or {}).items():
            bd[(v, r["tokens"], k)].append(us)
for n in (8, 16, 128):
    print(n, "new", [round(x, 1) for x in t[("new", n)]], "old", [round(x, 1) for x in t[("old", n)]],
          "new/old %.3f" % (st.median(t[("new", n)]) / st.median(t[("old", n)])))
for key in sorted(k for k in bd if k[0] == "new"):
    o = bd.get(("old",) + key[1:])
    print(key[1], key[2][:70], "new %.1f" % st.median(bd[key]), "old %.1f" % st.median(o) if o else "old -")
PY
tar -czf "$OUT/ab.tgz" -C /tmp ab
cd "$repo"
export MOEHAL_GPU_FUZZ_SHRINK=0
MOEHAL_GPU_FUZZ_EXAMPLES=30 MOEHAL_GPU_FUZZ_SEED=72 step gpu-fuzz-72 150 python3 -m pytest -s -q \
  -p no:cacheprovider tests/cuda/test_gpu_fuzz.py -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-72.log"; tail -n 2 "$OUT/gpu-fuzz-72.log"
cat "$OUT/steps.txt"
exit 0
