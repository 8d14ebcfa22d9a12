"""Does DeepGEMM's `expected_m` hint matter at prefill sizes? (a diagnostic for #4's 1024-token goal)

DeepGEMM's masked grouped GEMM picks its tile (block M/N, waves) from `expected_m`, a host int.
The dispatcher passes the mean rows per expert; with random routing half the experts get more
than the mean, so a tile chosen for exactly the mean may need one more M block for them. This
times each GEMM of the prefill shapes with `expected_m` = the mean times several factors, on the
same 8 routings (`moehal_cuda.tuning.routing_counts`, CUDA graph, CUDA events).

    python tools/expected_m_sweep.py [--tokens 1024,2048] [--shapes deepseek_v3_ep8,mixtral_8x7b]
        [--quant fp8_block] [--factors 0.5,1] [--hints 64,32]

`--hints` adds absolute values: DeepGEMM breaks a tie in M blocks towards the smaller block M,
so a hint of at most 64 makes it pick 64-row tiles (fewer padded rows per expert when the
mean is just above a multiple of 128), whatever the batch.
"""

from __future__ import annotations

import argparse
import functools

import torch
from moehal.bench import SHAPES
from moehal_cuda.deepgemm_experts import DeepGemmOps
from moehal_cuda.tuning import ROTATIONS, Problem, routing_counts, time_graph

FACTORS = (0.5, 1.0, 1.0625, 1.125, 1.25, 1.5, 2.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="deepseek_v3_ep8,mixtral_8x7b,qwen3_30b_a3b")
    p.add_argument("--tokens", default="1024,2048,4096")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS), help="hints as multiples of the mean")
    p.add_argument("--hints", default="", help="absolute hints, e.g. 64,32")
    a = p.parse_args()
    factors = [float(f) for f in a.factors.split(",") if f]
    hints = [int(h) for h in a.hints.split(",") if h]
    dev = torch.device("cuda")
    fp8 = a.quant == "fp8_block"
    ops = DeepGemmOps(fp8, False, replay_graphs=False)
    tokens = [int(t) for t in a.tokens.split(",")]
    for shape in a.shapes.split(","):
        s = SHAPES[shape]
        e, h, i, top_k = s["num_experts"], s["hidden_size"], s["intermediate_size"], s["top_k"]
        for n, k in ((2 * i, h), (h, i)):
            prob = Problem(e, n, k, max(tokens), fp8, dev)
            for t in tokens:
                counts = [c.to(dev) for c in routing_counts(t, e, top_k, ROTATIONS, seed=t)]
                mean = max(1, -(-t * top_k // e))
                hi = max(int(c.max()) for c in counts)
                flops = 2 * t * top_k * n * k
                cells = []
                tries = [(f"x{f:g}", max(1, int(mean * f))) for f in factors] + [(f"={h}", h) for h in hints]
                for label, em in tries:
                    us = time_graph([functools.partial(prob.deepgemm, ops, c, em) for c in counts])
                    cells.append(f"{label}={us:7.1f}us/{flops / us / 1e6:4.0f}TF")
                print(f"{shape:16s} N={n:5d} K={k:5d} T={t:5d} mean_m={mean:4d} max_m={hi:4d}  " + "  ".join(cells))
            del prob
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
