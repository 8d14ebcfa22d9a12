#!/usr/bin/env bash
# Session 43, call 1 (a fresh machine; DeepGEMM's wheels and the small ones carried, SGLang's in
# call 2, as the tree and all wheels pass the 64 MiB a call carries): this session's kernel
# changes on the GPU (the streaming-read kernel of the read ceiling, the split combine's explicit
# barrier, the masked GEMMs' int32 guard) and the streaming kernel's rate per config at 1 and 4 GiB.
#   usage (repo root, .whl present): bash <this file>
set -u
ls .whl
source tools/device_setup.sh
record_env
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib"
step tests 240 $PYT tests/core/test_bench.py tests/core/test_token_moe.py tests/cuda/test_triton_grouped_gemm.py
tail -n 3 "$OUT/tests.log"
step stream 120 python3 - <<'PY'
import torch
from moehal.bench import _stream_read_rates, time_call
dev = torch.device("cuda")
for gib in (1, 4):
    src = torch.randn(gib << 28, device=dev)
    t = time_call(lambda: src.sum(), dev, reps=20, warmup_s=0.5)
    print(f"{gib} GiB torch.sum {src.numel() * 4 / t / 1e12:.3f} TB/s")
    for rate, name in _stream_read_rates(src, 0.5):
        print(f"{gib} GiB {name} {rate / 1e12:.3f} TB/s")
    del src
PY
cat "$OUT/stream.log"
cat "$OUT/steps.txt"
