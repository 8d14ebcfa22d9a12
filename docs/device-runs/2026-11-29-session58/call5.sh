#!/usr/bin/env bash
# Session 58, call 5 (a fresh H200): this session's final code. What changed on the GPU's side:
# the contiguous layout's row counts now come from moehal.permute (one definition, 0 rows for no
# slots; cuda.permute, DeepEP and the DeepGEMM experts size their buffers with it), the weight
# processor lookup (own backend first), MoELayer's name notes around the forward. So: CUDA
# conformance's `shapes` family on the contiguous layouts (0, 1 and 33 tokens, one expert, idle
# experts, no local slots) beside the GPU tests of the permute, the plugin declarations, errors
# and selection; then the docs' code samples, whose GPU samples (README, user guide) run in full
# here and only name-checked on CPUs.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
(cd /tmp && step conformance-contig 200 python3 -m moehal.cli.main conformance --backend cuda \
  -k "shapes/ and contiguous" --report "$OUT/conformance-contig") &
step tests 200 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_triton_permute.py tests/cuda/test_plugin.py tests/core/test_errors.py tests/core/test_permute.py \
  tests/core/test_public_api.py tests/core/test_plugins_and_selection.py
wait
step doc-samples 120 python3 -m pytest -q -p no:cacheprovider -rs -o addopts="--import-mode=importlib" \
  tests/test_doc_samples.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" "$OUT/doc-samples.log" | tail -n 20
grep -E "^SKIPPED" "$OUT/doc-samples.log"
tail -n 2 "$OUT/conformance-contig.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance-contig.log"
exit 0
