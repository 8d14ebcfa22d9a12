#!/usr/bin/env bash
# Session 45, call 1 (a fresh machine; DeepGEMM's wheels carried): conformance's new `tuned`
# family on the CUDA backend, the benchmark's three model shapes wherever this GPU's tables
# hold them, one batch size per path (token-major, each tile of the portable kernel, each masked
# plan of DeepGEMM and tuned Triton GEMMs), against the CPU oracle.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step tuned 560 python3 -m moehal.cli.main conformance --backend cuda -k tuned/ --report "$OUT/conformance-tuned"
tail -n 3 "$OUT/tuned.log"
cat "$OUT/steps.txt"
