#!/usr/bin/env bash
# Session 45, call 5 (a fresh machine; DeepGEMM's wheels carried): the CUDA backend's
# conformance on the final code, without the tuned cases (call 1 ran those; nothing on their
# path changed since but the NVFP4-dequant experts' declaration): the audit's new checks (the
# dispatcher's half of the grouped formats' contract at top-1 and top-2, strided inputs padded
# with NaN and with a K tail, SwiGLU-OAI clamps, features at the wide shape for DeepGEMM's FP8).
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step conformance 400 python3 -m moehal.cli.main conformance --backend cuda --quick -k "not tuned/" \
  --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/conformance.log"
cat "$OUT/steps.txt"
