#!/usr/bin/env bash
# Session 36, call 1 (a fresh GPU): conformance of the CUDA backend (quick) with the behaviour
# checks now run per claimed quant scheme (commit 20a6547): DeepGEMM's FP8 experts get their
# first cuda_graph, side_stream, inference_mode, out_buffer, strided_inputs and input_dtypes cases.
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 480 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 25 "$OUT/conformance.log"
grep -E "fail|error" "$OUT/conformance-cuda.md" | head -30
cat "$OUT/steps.txt"
