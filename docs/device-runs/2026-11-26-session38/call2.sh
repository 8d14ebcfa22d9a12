#!/usr/bin/env bash
# Session 38, call 2 (the same H100): the two_streams tests again (call 1's negative-control
# test ran the reference's check with the order still off), the order's host cost compared on
# one path (`MoELayer.forward` with and without its order; call 1 compared `forward` with
# `_forward`, which also skips nn.Module's call), then the whole CUDA GPU suite.
set -u
source tools/device_setup.sh
record_env
step pytest-streams 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_stream_order.py tests/conformance/test_suite.py -k "stream"
tail -n 3 "$OUT/pytest-streams.log"
step probe 120 python3 tools/two_streams_probe.py --skip-race
tail -n 9 "$OUT/probe.log"
step pytest-gpu 420 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py tests/conformance/test_suite.py
tail -n 8 "$OUT/pytest-gpu.log"
cat "$OUT/steps.txt"
