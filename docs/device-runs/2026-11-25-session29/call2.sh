#!/usr/bin/env bash
# Session 29, call 2: the whole GPU suite on this session's code (VERIFY on), then session 28's
# final tree (e877090, ab-old.tar.gz) against this one again, process by process, each process
# pinned to one CPU core (taskset) to cut the spread call 1 saw between processes, five rounds.
#   usage (repo root, .whl and ab-old.tar.gz carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
mkdir -p /tmp/oldtree && tar -xzf ab-old.tar.gz -C /tmp/oldtree
(cd /tmp/oldtree && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .)
step pytest-gpu 420 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
t0=$SECONDS
for r in 1 2 3 4 5; do
  for tree in old new; do
    pp=/tmp/site; [ $tree = old ] && pp=/tmp/site_old:/tmp/site
    echo "=== round $r tree $tree" >> "$OUT/tree-ab.log"
    timeout 40 env PYTHONPATH=$pp taskset -c 3 python3 tools/host_floor.py --eager-only \
      --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,8 >> "$OUT/tree-ab.log" 2>&1
    echo "rc=$?" >> "$OUT/tree-ab.log"
  done
done
echo "tree-ab $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
tail -n 3 "$OUT/pytest-gpu.log"
grep -E "===|rc=|eager forward" "$OUT/tree-ab.log" | head -150
cat "$OUT/steps.txt"
