#!/usr/bin/env bash
# Session 54, call 3 (one H200): the final code's GPU paths that this session's last changes
# touch. CUDA graphs per token count now share the rows they read and write (a review had
# counted sum(T) rows per layer), and the masked runners keep their recent row bounds' launches
# only. Steps: the memory the graphs of 256 token counts hold on one DeepSeek-V3 EP8 layer
# (tools/graph_rows_probe.py); the GPU tests of graphs, custom ops, launch memos and the
# DeepGEMM glue; then the conformance cases that run graphs and the poisoned-buffer checks.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step probe 200 python3 tools/graph_rows_probe.py --tokens 256
cat "$OUT/probe.log"
step tests 300 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/cuda/test_launch_memo.py tests/integrations/test_custom_op.py \
  tests/cuda/test_deepgemm_glue.py -k "graph or memo or custom or recent or out or inference"
tail -n 3 "$OUT/tests.log"
for fam in cuda_graph kept_outputs out_buffer; do
  step "conf-$fam" 150 python3 -m moehal.cli.main conformance --backend cuda -k "$fam/" --report "$OUT/conformance-$fam"
  tail -n 1 "$OUT/conf-$fam.log"
  rm -f "$OUT/conf-$fam.log"
done
cat "$OUT/steps.txt"
exit 0
