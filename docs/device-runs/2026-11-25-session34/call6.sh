#!/usr/bin/env bash
# Session 34, call 6 (H200): conformance of the CUDA backend with the inference_mode check; the
# GPU tests of buffers and graphs made under torch.inference_mode() and used under no_grad; the
# DeepGEMM psum tests (stand-in GEMM, GPU tensors).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 300 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step pytest-inference 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/cuda/test_deepgemm_psum.py tests/conformance/test_suite.py \
  -k "inference or psum or segment or local_slots or without_tokens or side_stream"
tail -n 3 "$OUT/conformance.log" "$OUT/pytest-inference.log"
cat "$OUT/steps.txt"
grep -hE "^\| inference_mode/" "$OUT/conformance-cuda.md" | cut -c1-200
rm -f "$OUT/conformance.log"
