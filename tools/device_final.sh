#!/usr/bin/env bash
# One GPU call with everything a change to the CUDA experts needs, most valuable first (each
# step time-boxed, at most 8 files in $OUT): the benchmark of issue #4 with SGLang beside it,
# the decode rows again without the fused GEMM1 + activation (A/B), the GPU tests, and the
# CUDA backend's conformance run.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_final.sh
set -u
source tools/device_setup.sh
record_env
cd /tmp
step bench 210 python3 "$repo/tools/sglang_peer.py" bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,4,16,128,1024,4096 --quant bf16,fp8_block --backends cuda,sglang --reps 20 --breakdown --out "$OUT/bench"
step unfused 110 python3 -c "
import sys
from moehal_cuda.deepgemm_experts import DeepGemmExpertsRunner
DeepGemmExpertsRunner.fuse_gemm1_activation = False
from moehal.bench import main
sys.exit(main(sys.argv[1:]))" --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,4,16,128,1024,4096 --quant bf16 \
  --backends cuda --reps 20 --breakdown --out "$OUT/unfused"
rm -f "$OUT/unfused.png" "$OUT/unfused.log" "$OUT/bench.png"
cd "$repo"
step pytest-gpu 120 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_gpu.py tests/cuda/test_triton_grouped_gemm.py tests/cuda/test_deepgemm_glue.py
cd /tmp
step conformance 140 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
tail -n 3 "$OUT/pytest-gpu.log" "$OUT/conformance.log"
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
