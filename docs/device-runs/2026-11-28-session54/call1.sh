#!/usr/bin/env bash
# Session 54, call 1 (two H200s, nvidia-h200-x2): what needs two GPUs, which last ran in session
# 38 (EP over NCCL) and session 38's call 5 (the multi-device tests); since then sessions 39-53
# changed the dispatch, the workspaces and the EP budget. Steps: the EP suite over NCCL with the
# reference and the `cuda` experts; the GPU test suite with both GPUs visible (the multi-device
# tests run); beside it, on GPU 1 alone, the GPU fuzz with a seed no session has drawn (64).
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
run2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"  # a command: `timeout` runs no shell function
# shellcheck disable=SC2086  # run2 is a list of words
step ep-reference 200 $run2 tools/ep_gpu_check.py --out "$OUT/ep-nccl-reference.md"
# shellcheck disable=SC2086
step ep-cuda 200 $run2 tools/ep_gpu_check.py --backend cuda --out "$OUT/ep-nccl-cuda.md"
tail -n 4 "$OUT"/ep-nccl-*.md
(
  export MOEHAL_GPU_FUZZ_SHRINK=0 MOEHAL_GPU_FUZZ_EXAMPLES=60 MOEHAL_GPU_FUZZ_SEED=64 CUDA_VISIBLE_DEVICES=1
  step gpu-fuzz-64 330 python3 -m pytest -s -q -p no:cacheprovider tests/cuda/test_gpu_fuzz.py \
    -k test_cuda_backend_on_the_gpu
) &
step multi-device 120 python3 -m pytest -v -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_multi_device.py
step tests 420 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  tests/cuda tests/core/test_token_moe.py tests/core/test_stream_order.py tests/integrations/test_custom_op.py \
  -k "not test_cuda_backend_on_the_gpu" --deselect tests/cuda/test_multi_device.py
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 20
grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/multi-device.log"
grep -c "^passed" "$OUT/gpu-fuzz-64.log"; tail -n 2 "$OUT/gpu-fuzz-64.log"
for s in ep-reference ep-cuda; do  # a passing step's table is in its .md
  grep -q "^$s rc=0" "$OUT/steps.txt" && rm -f "$OUT/$s.log"
done
cat "$OUT/steps.txt"
exit 0
