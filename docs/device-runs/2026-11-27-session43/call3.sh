#!/usr/bin/env bash
# Session 43, call 3 (a fresh machine; DeepGEMM's wheels and the small ones carried): how the
# stream ceilings depend on the buffer size (copy, torch.sum and the streaming kernel at 1, 2 and
# 4 GiB), then the GPU tests on this session's code (the selection, plugin, CLI, routing and
# config fixes among them; the in-place graph and layer-copy tests are new).
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
step stream-sizes 150 python3 - <<'PY'
import functools, torch
from moehal.bench import _stream_read_rates, time_call
dev = torch.device("cuda")
for gib in (1, 2, 4):
    src = torch.randn(gib << 28, device=dev)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    t = time_call(functools.partial(dst.copy_, src), dev, reps=20, warmup_s=0.5)
    print(f"{gib} GiB copy {2 * nbytes / t / 1e12:.3f} TB/s")
    t = time_call(src.sum, dev, reps=20, warmup_s=0.5)
    print(f"{gib} GiB torch.sum {nbytes / t / 1e12:.3f} TB/s")
    best = max(_stream_read_rates(src, 0.5))
    print(f"{gib} GiB best {best[1]} {best[0] / 1e12:.3f} TB/s")
    del src, dst
    torch.cuda.empty_cache()
PY
cat "$OUT/stream-sizes.log"
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib"
step tests 430 $PYT tests/cuda tests/integrations/test_custom_op.py tests/core/test_graph_cache.py tests/core/test_bench.py tests/core/test_token_moe.py
tail -n 3 "$OUT/tests.log"
cat "$OUT/steps.txt"
