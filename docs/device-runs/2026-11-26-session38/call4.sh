#!/usr/bin/env bash
# Session 38, call 4 (two GPUs): a layer on cuda:1 called while cuda:0 is current. The layer now
# makes its device current while a forward queues (moehal.stream_order); the probe runs the same
# forwards with and without that (the latter in a child process), then the GPU tests: the
# multi-device tests, and the stream tests again after the conformance runner's refactor.
set -u
source tools/device_setup.sh
record_env
step probe 150 python3 tools/other_device_probe.py
cat "$OUT/probe.log"
step pytest 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_multi_device.py tests/core/test_stream_order.py tests/conformance/test_suite.py -k "device or stream"
tail -n 5 "$OUT/pytest.log"
cat "$OUT/steps.txt"
