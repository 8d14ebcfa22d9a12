"""Session 53: device time of `contiguous_grouped_gemm` at Qwen3-30B-A3B's prefill GEMMs (128
experts, 256 rows each, as 4096 tokens at top-8 give; GEMM1 K=2048 N=1536, GEMM2 K=768 N=2048),
CUDA-graph replays of 20 calls, median of 15. Run once per code version (PYTHONPATH) and compare.
"""

import statistics
import sys

import torch
from moehal.kernels.triton_grouped_gemm import contiguous_grouped_gemm

label = sys.argv[1]
e, rows = 128, 256
m = e * rows
re = torch.arange(e, dtype=torch.int32, device="cuda").repeat_interleave(rows)
for name, k, n in (("gemm1", 2048, 1536), ("gemm2", 768, 2048)):
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(e, n, k, device="cuda") / k**0.5).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    scale = torch.full((e,), 0.5, device="cuda")
    for _ in range(3):
        contiguous_grouped_gemm(a, w, out, re, 128, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            contiguous_grouped_gemm(a, w, out, re, 128, scale)
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20)
    print(f"{label} {name}: {statistics.median(times):.1f} us per call", flush=True)
