#!/usr/bin/env bash
# Session 50, call 3 (H200): the NVFP4 experts for Hopper without DeepGEMM. With the wheels
# installed: the plugin and experts tests and a GPU fuzz of nvfp4 layers only (their w13 biases
# now drawn too). Then DeepGEMM's package removed from the install: `moehal explain` for a
# Qwen3-30B-A3B nvfp4 layer (which experts accept it, which decline and why) and conformance's
# nvfp4 cases.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 120 python3 -m pytest -q -p no:cacheprovider -rA tests/cuda/test_plugin.py \
  tests/cuda/test_deepgemm_glue.py tests/cuda/test_triton_grouped_gemm.py -k "nvfp4 or bias or plugin or deep_gemm"
tail -n 1 "$OUT/tests.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=30 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=50 MOEHAL_GPU_FUZZ_SCHEMES=nvfp4
step gpu-fuzz-nvfp4 200 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-nvfp4.log"; grep -c "has_w13_bias=True" "$OUT/gpu-fuzz-nvfp4.log"; tail -n 2 "$OUT/gpu-fuzz-nvfp4.log"
rm -rf /tmp/site/deep_gemm /tmp/site/deep_gemm-* /tmp/site/sgl_deep_gemm*
python3 -c "import deep_gemm" 2>&1 | tail -n 1
step explain-no-deepgemm 60 python3 -m moehal.cli.main explain --experts 128 --top-k 8 --hidden 2048 \
  --intermediate 768 --quant nvfp4 --max-tokens 4096 --backend cuda
grep -i "nvfp4_dequant\|deep_gemm\|selected\|->" "$OUT/explain-no-deepgemm.log" | head -n 20
step conformance-no-deepgemm 120 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 \
  --report "$OUT/conformance-nvfp4-no-deepgemm"
tail -n 1 "$OUT/conformance-no-deepgemm.log"
rm -f "$OUT/conformance-no-deepgemm.log"
cat "$OUT/steps.txt"
