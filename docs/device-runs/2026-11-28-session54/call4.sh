#!/usr/bin/env bash
# Session 54, call 4 (one H200): the thread fixes that touch the GPU path. moehal's graph
# captures now use thread_local capture errors and a collector pause counted across threads.
# Steps: the graph-memory probe again; the GPU tests of graphs, memos, custom ops, inference
# mode and buffers; conformance's cuda_graph and two_streams families.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step probe 150 python3 tools/graph_rows_probe.py --tokens 128
cat "$OUT/probe.log"
step tests 240 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/cuda/test_launch_memo.py tests/integrations/test_custom_op.py \
  -k "graph or memo or custom or inference or stream"
tail -n 2 "$OUT/tests.log" | tee "$OUT/tests-summary.txt"
rm -f "$OUT/tests.log"
for fam in cuda_graph two_streams; do
  step "conf-$fam" 120 python3 -m moehal.cli.main conformance --backend cuda -k "$fam/" --report "$OUT/conformance-$fam"
  tail -n 1 "$OUT/conf-$fam.log"
  rm -f "$OUT/conf-$fam.log" "$OUT/conformance-$fam.json"
done
cat "$OUT/steps.txt"
exit 0
