#!/usr/bin/env bash
# Session 55, call 3 (one H200): the final code. CUDA conformance without the `tuned` family
# (fresh allocations poisoned; UE8M0 scales from the float's bits in the Triton quantizers;
# graphs whose capture fails give the input back) and, beside it on the same GPU, the tests call
# 2 failed or did not reach before its time limit: the SM100 scale-check and portable-runner
# tests as mended, the stream-order, quant and custom-op files, and the new plugin, table,
# interpret-mode, graph-cache and error tests.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
(
  step tests 300 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
    "tests/cuda/test_deepgemm_glue.py::test_sm100_weights_get_their_scale_transform_whoever_loads_them" \
    "tests/cuda/test_deepgemm_glue.py::test_sm100_weights_with_negative_power_of_two_scales_are_refused" \
    "tests/cuda/test_deepgemm_glue.py::test_a_portable_runner_whose_build_raises_is_built_again_next_call" \
    "tests/cuda/test_triton_grouped_gemm.py::test_a_table_tuned_outside_the_package_is_registered_by_path" \
    tests/cuda/test_plugin.py tests/core/test_stream_order.py tests/core/test_quant.py \
    tests/integrations/test_custom_op.py tests/core/test_kernel_host.py tests/core/test_graph_cache.py \
    tests/core/test_errors.py
) &
step conformance 420 python3 -m moehal.cli.main conformance --backend cuda -k "not tuned/" --report "$OUT/conformance-cuda"
tail -n 4 "$OUT/conformance.log"
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
exit 0
