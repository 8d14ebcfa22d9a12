#!/usr/bin/env bash
# Session 38, call 1: forwards in one order across streams (moehal.stream_order).
# The GPU tests of the order and of conformance's two_streams check (its shared-buffer negative
# control fails with the order off and passes with it on); the race on the CUDA backend's own
# kernels, off and on, and the order's host cost (tools/two_streams_probe.py); then the whole
# CUDA conformance run, two_streams included.
set -u
source tools/device_setup.sh
record_env
step pytest-streams 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_stream_order.py tests/conformance/test_suite.py -k "stream"
tail -n 5 "$OUT/pytest-streams.log"
step probe 200 python3 tools/two_streams_probe.py
cat "$OUT/probe.log" | tail -n 45
cd /tmp
step conformance 330 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 26 "$OUT/conformance.log"
grep -E "two_streams" "$OUT/conformance-cuda.md" | head -30
cat "$OUT/steps.txt"
