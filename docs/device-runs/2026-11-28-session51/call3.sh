#!/usr/bin/env bash
# Session 51, call 3 (H200): call 2 found GEMM1 11 us slower with the input quantized in its K loop;
# now a launch quantizes the input and GEMM1 writes the activation quantized (three launches). The
# kernel tests; conformance's nvfp4 cases; 20 fuzzed nvfp4 layers; a graph trace; an A/B against
# the masked path and bf16, timed as `moehal bench` times.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/core/test_token_moe.py tests/cuda/test_deepgemm_glue.py \
  -k "token or small or nvfp4"
tail -n 1 "$OUT/tests.log"
step conformance 60 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
export MOEHAL_GPU_FUZZ_EXAMPLES=20 MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_SEED=53 MOEHAL_GPU_FUZZ_SCHEMES=nvfp4
step gpu-fuzz-nvfp4 90 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
  -k test_cuda_backend_on_the_gpu
grep -c "^passed" "$OUT/gpu-fuzz-nvfp4.log"; grep -c "standard" "$OUT/gpu-fuzz-nvfp4.log"; tail -n 2 "$OUT/gpu-fuzz-nvfp4.log"
step trace-nvfp4 60 python3 tools/graph_trace.py --quant nvfp4 --tokens 1,4
cat "$OUT/trace-nvfp4.log"
cd /tmp && export COLUMNS=220
step ab-decode 200 python3 "$repo/tools/bench_ab.py" --variants shipped,nvfp4-masked-decode --rounds 2 \
  --cases "qwen3_30b_a3b:nvfp4:1,2,4,8 deepseek_v3_ep8:nvfp4:1 qwen3_30b_a3b:bf16:1,4"
cat "$OUT/ab-decode.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
