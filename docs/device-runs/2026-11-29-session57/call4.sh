#!/usr/bin/env bash
# Session 57, call 4 (one H200): the code after call 3 changed how weights are built at load
# (quantize_weights one expert at a time, from_per_expert into one allocation, to_fnuz). The
# GPU tests of quantization, checkpoints and the NVFP4 dequantizing path; beside them, CUDA
# conformance `--quick` of the fp8 cases (their oracles quantize with quantize_weights).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
(
  cd /tmp
  step conformance-fp8 240 python3 -m moehal.cli.main conformance --backend cuda --quick -k fp8 \
    --report "$OUT/conformance-fp8"
) &
step tests 240 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda/test_quant_bits.py tests/core/test_checkpoint_weights.py tests/core/test_quant.py \
  tests/cuda -k "nvfp4 or quant or checkpoint or fp8" --deselect tests/cuda/test_multi_device.py \
  --deselect tests/cuda/test_gpu_fuzz.py
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 12
tail -n 2 "$OUT/conformance-fp8.log"
cat "$OUT/steps.txt"
rm -f "$OUT/conformance-fp8.log"
exit 0
