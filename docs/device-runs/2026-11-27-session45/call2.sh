#!/usr/bin/env bash
# Session 45, call 2 (call 1's machine): the rest of the CUDA backend's conformance (-k 'not
# tuned/'), and the GPU tests of what this session changed (DeepGEMM's masked plan as one pure
# function, the tuned-shape declarations, the benchmark's output check).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step conformance 280 python3 -m moehal.cli.main conformance --backend cuda --quick -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib"
step tests 260 $PYT tests/cuda/test_gpu.py tests/cuda/test_tuned_shapes.py tests/cuda/test_triton_grouped_gemm.py \
  tests/core/test_bench.py tests/conformance/test_tuned_shapes.py
tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
