#!/usr/bin/env bash
# Session 59, call 1 (a fresh H200): the GPU suite on session 58's final code (1f3f654). Session
# 58 ran the full suite only on session 57's code (984ba64) and a subset on its own. Beside it,
# on the same GPU, the tests session 58 added or changed (public API, plugin declarations,
# selection, errors, permute) and the docs' code samples, whose GPU samples run in full here.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
(step api-tests 300 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/core/test_errors.py tests/core/test_permute.py tests/core/test_public_api.py \
  tests/core/test_plugins_and_selection.py tests/test_doc_samples.py) &
step tests 500 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/core/test_stream_order.py tests/core/test_layer_lifetime.py \
  tests/integrations/test_custom_op.py -k "not test_cuda_backend_on_the_gpu" --deselect tests/cuda/test_multi_device.py
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" "$OUT/api-tests.log" | tail -n 20
grep -E "^SKIPPED" "$OUT/api-tests.log" | head
cat "$OUT/steps.txt"
exit 0
