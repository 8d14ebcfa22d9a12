#!/usr/bin/env bash
# Session 44, call 1 (a fresh machine; DeepGEMM's wheels and the small ones carried, SGLang's in
# call 2): the GPU tests of what this session changed on the benchmark side (skipped rows saved,
# goals pairing within a file, the peer's config probe faked), and the layer tests.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib"
step tests 240 $PYT tests/core/test_bench_goals.py tests/integrations/test_sglang_peer.py tests/core/test_bench.py \
  tests/cuda/test_gpu.py
tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
