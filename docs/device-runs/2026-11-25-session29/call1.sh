#!/usr/bin/env bash
# Session 29, call 1: pinned launches give GPU tensors to Triton's launcher as addresses, and the
# decode paths take their per-call scratch from process-wide buffers. The GPU tests of the launch
# paths, the token-major kernels and the permute (VERIFY on), then host times: the floor rows and
# the interleaved modes (launch.RAW_POINTERS off as one of them), then session 28's final tree
# (e877090, carried as ab-old.tar.gz) against this one, process by process, three rounds.
#   usage (repo root, .whl and ab-old.tar.gz carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
mkdir -p /tmp/oldtree && tar -xzf ab-old.tar.gz -C /tmp/oldtree
(cd /tmp/oldtree && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .)
step pytest-launch 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/core/test_fast_launch.py tests/cuda/test_fast_launch.py tests/core/test_token_moe.py \
  tests/cuda/test_triton_permute.py tests/cuda/test_gpu.py tests/integrations/test_custom_op.py
step host-floor 200 python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,8,128
t0=$SECONDS
for r in 1 2 3; do
  for tree in old new; do
    pp=/tmp/site; [ $tree = old ] && pp=/tmp/site_old:/tmp/site
    echo "=== round $r tree $tree" >> "$OUT/tree-ab.log"
    timeout 60 env PYTHONPATH=$pp python3 tools/host_floor.py --eager-only \
      --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b --tokens 1,8 >> "$OUT/tree-ab.log" 2>&1
    echo "rc=$?" >> "$OUT/tree-ab.log"
  done
done
echo "tree-ab $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
tail -n 3 "$OUT/pytest-launch.log"
grep -E "RAW_POINTERS|default\)|as addresses|CompiledKernel" "$OUT/host-floor.log"
grep -E "===|eager forward  *$|site|eager forward$" "$OUT/tree-ab.log" | head -80
cat "$OUT/steps.txt"
