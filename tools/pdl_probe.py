"""Programmatic dependent launch of the token-major decode pair (`moehal.kernels.triton_token_moe`),
measured: GEMM1 + activation, then the combine launched early and prefetching its w2 rows into
L2 before it waits for GEMM1. A diagnostic for #4's 1-4 token rows (Qwen3-30B-A3B at one token:
26 us against an 18 us roofline on an H200, the two kernels' gap and ramps being the rest).

    python3 tools/pdl_probe.py [--shapes qwen3_30b_a3b,...] [--tokens 1,2,4] [--rounds 5]

Variants, each a `TokenMoE` bound with the module's switches set as named: `off` (in order, as
before), `pdl` (launched early, no prefetch), `pdl+l2` (prefetch, the cache's default policy),
`pdl+l2last` (prefetch marked evict-last: the default). Each is checked bitwise against `off`.
Timing: a CUDA graph of the pair, replayed 10 times back to back per sample, 20 samples per
round, the variants taking turns round by round; "1 layer" replays one layer's weights (as
`moehal bench` does: part of them stays in L2 between replays), "4 layers" four layers' weights
one after another in one graph (each layer's weights colder, as in a model's step).
Then a profiler trace of one replay per variant (kernel start, duration, gap).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch

VARIANTS = {"off": (False, 0), "pdl": (True, 0), "pdl+l2": (True, 1), "pdl+l2last": (True, 2)}


def make_weights(shape: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` layers' (w13, w2) of a bench shape: random, one set per layer, on the GPU."""
    from moehal.bench import SHAPES
    from moehal.config import MoEConfig

    cfg = MoEConfig(**SHAPES[shape])
    out = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)
        w13 = torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, generator=g, device="cuda")
        w2 = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g, device="cuda")
        out.append(((w13 / cfg.hidden_size**0.5).to(cfg.dtype), (w2 / cfg.intermediate_size**0.5).to(cfg.dtype)))
    return out


def make_layers(shape: str, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """A TokenMoE per layer's weights (the variants share the tensors; each binds its own plans)."""
    from moehal.bench import SHAPES
    from moehal.config import MoEConfig
    from moehal.kernels import triton_token_moe as tm
    from moehal.kernels.triton_fused_moe import _ACTS

    cfg = MoEConfig(**SHAPES[shape])
    act = _ACTS[cfg.activation.value]
    return [
        tm.TokenMoE(w13, None, w2, None, activation=act, gated=cfg.gated, alpha=0.0, limit=0.0, scaling=1.0)
        for w13, w2 in weights
    ]


def bind(layers: list, variant: str, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> list[torch.Tensor]:
    """Bind each layer's pair for this token count with the variant's switches; the outputs."""
    from moehal.kernels import triton_token_moe as tm

    tm.PDL, tm.PREFETCH = VARIANTS[variant]
    outs = []
    for moe in layers:
        moe._plans.clear()
        out = torch.empty_like(x)
        moe(x, ids, wts, out)
        outs.append(out)
    tm.PDL, tm.PREFETCH = True, 2
    return outs


def run_all(layers: list, outs: list, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """One decode step through every layer (each writes its own output); the last output."""
    for moe, out in zip(layers, outs, strict=True):
        moe(x, ids, wts, out)
    return outs[-1]


def graph_of(layers: list, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, outs: list) -> torch.cuda.CUDAGraph:
    from moehal.graphs import capture

    graph, _ = capture(functools.partial(run_all, layers, outs, x, ids, wts), torch.device("cuda"), warmup=2)
    return graph


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trace", default="qwen3_30b_a3b:1,qwen3_30b_a3b:4")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from graph_trace import replay_us
    from moehal.bench import SHAPES
    from moehal.config import MoEConfig
    from moehal.kernels import triton_token_moe as tm

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, pdl_supported: "
          f"{tm.pdl_supported(torch.device('cuda'))}")  # fmt: skip
    traces = {tuple(s.split(":")) for s in a.trace.split(",") if s}
    for shape in a.shapes.split(","):
        cfg = MoEConfig(**SHAPES[shape])
        weights = make_weights(shape, 4)
        sets = {n: {v: make_layers(shape, weights[:n]) for v in VARIANTS} for n in (1, 4)}
        for t in map(int, a.tokens.split(",")):
            g = torch.Generator().manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, generator=g).to("cuda", cfg.dtype)
            ids = torch.rand(t, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].to("cuda", torch.int32)
            wts = (torch.rand(t, cfg.top_k, generator=g) + 0.1).cuda()
            for n, by_variant in sets.items():
                graphs, exact = {}, []
                base = None
                for v, layers in by_variant.items():
                    outs = bind(layers, v, x, ids, wts)
                    graphs[v] = graph_of(layers, x, ids, wts, outs)
                    graphs[v].replay()
                    torch.cuda.synchronize()
                    if n == 1:  # every variant of one layer's weights: bitwise the in-order launch's
                        base = outs[0].clone() if base is None else base
                        exact.append(f"{v} {'==' if torch.equal(outs[0], base) else '!='} off")
                times: dict[str, list[float]] = {v: [] for v in graphs}
                for _ in range(a.rounds):
                    for v, graph in graphs.items():
                        times[v].append(replay_us(graph) / n)
                med = {v: statistics.median(ts) for v, ts in times.items()}
                cells = "  ".join(f"{v} {us:7.2f}" for v, us in med.items())
                gain = "  ".join(f"{v} {med[v] / med['off']:.3f}" for v in graphs if v != "off")
                print(f"{shape} T={t} {n} layer(s), us per layer: {cells}   vs off: {gain}")
                if exact:
                    print(f"  exact: {', '.join(exact)}")
                if n == 1 and (shape, str(t)) in traces:
                    from graph_trace import report, trace

                    for v, layers in by_variant.items():
                        outs = bind(layers, v, x, ids, wts)
                        step = functools.partial(run_all, layers, outs, x, ids, wts)
                        report(f"{shape} T={t} {v}", trace(step, 20))
        del sets, weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
