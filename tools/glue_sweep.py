"""Tiles of the prefill glue kernels, timed inside the whole layer: the activation
(`moehal_cuda.triton_glue.act_tile`) and the scatter (`moehal.kernels.triton_permute.scatter_tile`).
Each variant replaces one rule, captures the layer's forward into a CUDA graph, times its
replays and traces each kernel's device time (tools/graph_trace.py); the current rules are
traced again after every variant, so the table shows the noise. Variants are ranked by their
own kernel's time: the layer's replays drift by several percent between captures.

    python tools/glue_sweep.py [--shapes qwen3_30b_a3b] [--tokens 1024,4096] [--quant bf16,fp8_block]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], torch.Tensor]) -> float:
    from graph_trace import replay_us  # tools/ is this script's directory
    from moehal.bench import settle
    from moehal.graphs import capture

    graph, _ = capture(fn, torch.device("cuda"), warmup=1)
    settle(graph.replay, torch.device("cuda"), batch=4)  # timed as the benchmark times: settled clocks
    us = replay_us(graph, samples=7, per_sample=5)
    del graph
    return us


def random_case(shape: str, tokens: int, max_tokens: int, dev: torch.device, weights: bool = True) -> tuple:
    """A benchmark shape's config (built for `max_tokens`), random canonical weights w13 and w2
    (on the host; None with `weights=False`, whose batch then comes from another seed), and a
    batch on `dev`: hidden states, distinct top-k ids, positive weights."""
    import moehal
    from moehal.bench import SHAPES

    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max_tokens)
    g = torch.Generator().manual_seed(0 if weights else 1)
    w13 = w2 = None
    if weights:
        w13 = torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
        w2 = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g)
        w2 /= cfg.intermediate_size**0.5
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(dev, cfg.dtype)
    ids = torch.rand(tokens, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].to(dev, torch.int32)
    wts = (torch.rand(tokens, cfg.top_k, generator=g) + 0.1).to(dev)
    return cfg, w13, w2, x, ids, wts


def print_ranked(label: str, bases: list[float], results: list[tuple[float, str]]) -> None:
    """The baseline's median over its captures, then every variant, fastest first, against it."""
    b0 = statistics.median(bases)
    print(f"  {label}: {b0:.1f} us (min {min(bases):.1f}, max {max(bases):.1f}, {len(bases)} captures)")
    for us, name in sorted(results):
        print(f"  {us:9.1f} us  {100 * (us / b0 - 1):+6.1f}%  {name}")


def main() -> None:
    import moehal_cuda.triton_glue as glue

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--quant", default="bf16,fp8_block")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--budget-s", type=float, default=400)
    p.add_argument("--act-spans", default="256,384,512,768", help="activation column spans to try")
    p.add_argument("--act-warps", default="4,8")
    p.add_argument("--act-rows", default="16,32", help="activation rows per program")
    p.add_argument("--act-loads", default="1", help="activation column blocks per load (ActTile.blocks_per_load)")
    p.add_argument("--act", action=argparse.BooleanOptionalAction, default=True, help="try activation tiles")
    p.add_argument("--scatter", action=argparse.BooleanOptionalAction, default=True, help="also try scatter tiles")
    p.add_argument("--scatter-blocks", default="8,16,32", help="slots per scatter program")
    p.add_argument("--scatter-spans", default="2,4,8", help="scatter columns per program, in column blocks")
    p.add_argument("--scatter-warps", default="4,8")
    p.add_argument("--scatter-loads", default="1", help="scatter column blocks per load (ScatterTile.blocks_per_load)")
    p.add_argument("--scatter-token-rows", default="0", help="0,1: ScatterTile.token_rows off / on")
    a = p.parse_args()
    spans, warps, rows, loads = (
        tuple(map(int, v.split(","))) for v in (a.act_spans, a.act_warps, a.act_rows, a.act_loads)
    )
    act_variants = [glue.ActTile(*v) for v in itertools.product(rows, spans, warps, loads)] if a.act else []
    sb, ss, sw, sl, st = (
        tuple(map(int, v.split(",")))
        for v in (a.scatter_blocks, a.scatter_spans, a.scatter_warps, a.scatter_loads, a.scatter_token_rows)
    )
    # a load wider than the program's columns is not a tile
    scatter_variants = [v for v in itertools.product(sb, ss, sw, sl, st) if v[3] <= v[1]] if a.scatter else []
    print(torch.cuda.get_device_name())
    cases = list(itertools.product(a.shapes.split(","), a.quant.split(","), map(int, a.tokens.split(","))))
    for shape, q, t in cases:  # an equal share of the time budget each
        t_end = time.monotonic() + a.budget_s / len(cases)
        sweep_case(shape, q, t, max(t, a.max_tokens), act_variants, scatter_variants, t_end)
        torch.cuda.empty_cache()


def kernel_times(fn: Callable[[], torch.Tensor]) -> tuple[float, dict[str, float]]:
    """The replayed forward's time and each kernel's device time in it (us; tools/graph_trace.py:
    CUPTI's durations, medians over replays), summed per kernel name."""
    from graph_trace import trace

    rows, us = trace(fn, replays=20)
    per: dict[str, float] = {}
    for name, _, dur, _ in rows:
        per[name] = per.get(name, 0.0) + dur
    return us, per


def sweep_case(
    shape: str, q: str, t: int, max_tokens: int, act_variants: list, scatter_variants: list, t_end: float
) -> None:
    """Each variant's layer time and its own kernel's device time, with the current rules traced
    again after every variant: the kernel's time is the comparison that holds when the layer's
    replays drift by several percent between captures (clocks), as they do on an H200."""
    import moehal
    import moehal.kernels.triton_permute as tp
    import moehal_cuda.triton_glue as glue

    dev = torch.device("cuda")
    act_rule, scatter_rule = glue.act_tile, tp.scatter_tile
    cfg, w13, w2, x, ids, wts = random_case(shape, t, max_tokens, dev)
    layer = moehal.MoELayer(cfg, q, device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13.to(dev), w2.to(dev)))

    def fwd() -> torch.Tensor:
        return layer(x, ids, wts)

    def scatter(b: int, mult: int, w: int, ld: int, tr: int) -> Callable:
        def rule(s: int, h: int, bh: int, **_: object) -> tp.ScatterTile:
            return tp.ScatterTile(b, min(mult * bh, -(-h // bh) * bh), w, ld, bool(tr))

        return rule

    variants = [("_act_rows", f"act {v}", "act_tile", lambda rows, block_i, v=v: v) for v in act_variants]
    variants += [
        ("_scatter_rows", f"scatter block_s={b} h_span={m}xBLOCK_H warps={w} blocks_per_load={ld} token_rows={tr}",
         "scatter_tile", scatter(b, m, w, ld, tr))
        for b, m, w, ld, tr in scatter_variants
    ]  # fmt: skip
    print(f"== {shape} {q} T={t}: {layer.plan.pipeline.name}")
    base = [kernel_times(fwd)]
    results: list[tuple[float, float, str, str]] = []  # (kernel us, layer us, kernel, name)
    for kernel, name, attr, rule in variants:
        if time.monotonic() > t_end:
            print("  time budget reached")
            break
        module, saved = (glue, act_rule) if attr == "act_tile" else (tp, scatter_rule)
        setattr(module, attr, rule)
        try:
            us, per = kernel_times(fwd)
            results.append((per.get(kernel, float("nan")), us, kernel, name))
        except Exception as exc:  # noqa: BLE001 - a tile that cannot launch here
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:80]}")
        finally:
            setattr(module, attr, saved)
        base.append(kernel_times(fwd))
    layer_b = [us for us, _ in base]
    lb = statistics.median(layer_b)
    print(f"  current rules, layer: {lb:.1f} us (min {min(layer_b):.1f}, max {max(layer_b):.1f}, {len(base)} captures)")
    for kernel in ("_scatter_rows", "_act_rows", "_combine_rows"):
        ks = [per.get(kernel, float("nan")) for _, per in base]
        print(f"  current rules, {kernel}: {statistics.median(ks):.2f} us (min {min(ks):.2f}, max {max(ks):.2f})")
    for k_us, us, kernel, name in sorted(results, key=lambda r: (r[2], r[0])):
        kb = statistics.median(per.get(kernel, float("nan")) for _, per in base)
        print(f"  {kernel:14s} {k_us:8.2f} us {100 * (k_us / kb - 1):+6.1f}%   layer {us:8.1f} us   {name}")


if __name__ == "__main__":
    main()
