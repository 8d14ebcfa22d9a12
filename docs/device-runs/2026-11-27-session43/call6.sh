#!/usr/bin/env bash
# Session 43, call 6 (a fresh machine; DeepGEMM's wheels and the small ones carried, SGLang's in
# call 7): the layer tests of this session's lifecycle fixes (in-place graphs, copies) on it.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib"
step tests 200 $PYT tests/cuda/test_gpu.py tests/core/test_token_moe.py
tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
