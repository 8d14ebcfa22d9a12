#!/usr/bin/env bash
# Session 44, call 3 (a fresh machine; DeepGEMM's wheels carried): this session's final code on
# the GPU. Conformance of the CUDA backend (selection's small-batch rule changed signature), and
# the GPU tests that compare with the float64 loop, which now rounds where kernels do.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step conformance 280 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib"
step tests 200 $PYT tests/integrations/test_custom_op.py tests/core/test_bench_goals.py tests/core/test_reference_oracle.py
tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
