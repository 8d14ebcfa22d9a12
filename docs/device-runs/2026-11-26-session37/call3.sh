#!/usr/bin/env bash
# Session 37, call 3 (a fresh GPU): -1 top-k ids (MoEConfig.topk_padding) on the CUDA backend.
# Conformance (quick) now runs a padded_ids case per claimed scheme and path: cuda.permute's
# masked and contiguous scatters and combines, the token-major decode kernels and the portable
# Triton MoE, each fed every third token all -1 and single -1 slots. Then the GPU tests of the
# pieces: the permute kernels with -1 ids, the conformance negative control, the token-major
# kernels and the layer's checks.
set -u
source tools/device_setup.sh
record_env
step pytest-padding 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/conformance/test_suite.py tests/core/test_token_moe.py tests/core/test_errors.py
tail -n 5 "$OUT/pytest-padding.log"
cd /tmp
step conformance 420 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 26 "$OUT/conformance.log"
grep -E "padded_ids" "$OUT/conformance-cuda.md" | head -30
cat "$OUT/steps.txt"
