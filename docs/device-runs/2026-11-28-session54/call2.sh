#!/usr/bin/env bash
# Session 54, call 2 (two H200s): the review fixes that touch the GPU path, on the final code.
# - the multi-device tests, with the new one: runners are built with the layer's GPU current;
# - GPU tests of graphs that keep the buffers they write past release_workspaces, and the
#   inference-mode and contiguous tests beside them;
# - the whole CUDA conformance suite but `tuned`, poisoned as always: its padding family now also
#   runs every experts kernel on input whose padding rows hold NaN (DeepEP low latency leaves
#   them as they were).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step multi-device 120 python3 -m pytest -v -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_multi_device.py
grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/multi-device.log"
step tests 240 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/cuda/test_triton_permute.py tests/core/test_graph_cache.py \
  -k "graphs_keep or inference_mode or contiguous_path or fetched or released or graph"
tail -n 3 "$OUT/tests.log"
(cd /tmp && CUDA_VISIBLE_DEVICES=0 step conformance 400 python3 -m moehal.cli.main conformance --backend cuda \
  -k "not tuned/" --report "$OUT/conformance-cuda")
tail -n 12 "$OUT/conformance.log"
grep -c "also with NaN padding in" "$OUT/conformance-cuda.md"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
exit 0
