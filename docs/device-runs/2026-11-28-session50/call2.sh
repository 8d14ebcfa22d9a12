#!/usr/bin/env bash
# Session 50, call 2 (H200): the NVFP4 experts for Hopper with their biases in the Triton GEMMs'
# epilogues and the tuned table's bf16 Triton tiles: the kernel and experts tests, the pinned
# session-49 case, conformance's nvfp4 cases, the GPU fuzz's seed 10 past its example 31 (call 1
# gave it 70 s, too few), and an A/B of tuned against untuned tiles timed as `moehal bench` times.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 150 python3 -m pytest -q -p no:cacheprovider -rA tests/cuda/test_triton_grouped_gemm.py \
  tests/cuda/test_deepgemm_glue.py tests/cuda/test_gpu_fuzz.py -k "nvfp4 or bias or out_scale or contiguous or chooser or tiles or session49"
tail -n 1 "$OUT/tests.log"
step conformance 90 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=40 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=10
step gpu-fuzz-seed10 240 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-seed10.log"; tail -n 2 "$OUT/gpu-fuzz-seed10.log"
step ab-tiles 200 python3 tools/bench_ab.py --variants shipped,nvfp4-untuned --rounds 2 \
  --cases "qwen3_30b_a3b:nvfp4:1,16,128,2048 deepseek_v3_ep8:nvfp4:16,2048"
cat "$OUT/ab-tiles.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
