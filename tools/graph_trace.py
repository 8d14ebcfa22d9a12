"""Where a replayed decode step's time goes inside its CUDA graph: each kernel's start, duration
and the gap before it, for moehal's layer and (when importable) SGLang's fused MoE on the same
weights and routing. A diagnostic for #4's 1-token Qwen3-30B-A3B row, whose kernels sum to less
than the graph measures.

    python3 tools/graph_trace.py [--shape qwen3_30b_a3b] [--tokens 1,4] [--replays 20] \
        [--quant nvfp4] [--variant serial-qdq]

(it loads the SGLang peer itself, as tools/sglang_peer.py does for the benchmark)

Method: 20 back-to-back replays under torch.profiler (CUDA activity); the kernels of the last
10 replays are grouped per replay (by order) and each column is the median over them. "gap" is
the time from the previous kernel's end (or, for a replay's first kernel, the previous
replay's last kernel's end) to this kernel's start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch


def replay_us(graph: torch.cuda.CUDAGraph, samples: int = 20, per_sample: int = 10) -> float:
    """Median microseconds per replay, timing `per_sample` replays queued back to back (as the
    benchmark does)."""
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_sample):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_sample)
    return statistics.median(times)


def trace(fn: Callable[[], Any], replays: int) -> tuple[list[tuple[str, float, float, float]], float]:
    from moehal.graphs import capture
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph, _ = capture(fn, torch.device("cuda"), warmup=2)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    timed = replay_us(graph)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    ev = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0),
        key=lambda e: e.time_range.start,
    )
    if not ev or len(ev) % replays:
        print(f"  {len(ev)} kernel events for {replays} replays: cannot split them per replay")
        return [], timed
    per = len(ev) // replays
    rows = []
    for j in range(per):
        durs, gaps, starts = [], [], []
        for r in range(replays // 2, replays):
            i = r * per + j
            e = ev[i]
            durs.append(e.time_range.elapsed_us())
            gaps.append(e.time_range.start - ev[i - 1].time_range.end)
            starts.append(e.time_range.start - ev[r * per].time_range.start)
        name = ev[j].name.split("(")[0].split("<")[0][:48]
        rows.append((name, statistics.median(starts), statistics.median(durs), statistics.median(gaps)))
    return rows, timed


def report(title: str, traced: tuple[list[tuple[str, float, float, float]], float]) -> None:
    rows, timed = traced
    print(f"== {title}: {timed:.2f} us per replay (10 back to back, median of 20)")
    if not rows:
        return
    print(f"  {'kernel':48s} {'start':>8s} {'dur':>8s} {'gap':>7s}")
    for name, start, dur, gap in rows:
        print(f"  {name:48s} {start:8.2f} {dur:8.2f} {gap:7.2f}")
    busy = sum(r[2] for r in rows)
    gaps = sum(r[3] for r in rows)
    print(f"  kernels {busy:.2f} us + gaps {gaps:.2f} us = {busy + gaps:.2f} us per replay")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--quant", default="bf16", help="the layer's scheme (the SGLang peer runs bf16 only)")
    p.add_argument("--max-tokens", type=int, default=4096, help="the layer's max_tokens, as an engine builds it")
    p.add_argument("--variant", default="shipped", help="a code path of tools/bench_ab.py (`variant`)")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_ab import variant

    with variant(a.variant):
        run(a)


def run(a: argparse.Namespace) -> None:
    import moehal
    from moehal.bench import SHAPES

    peer = None
    try:
        import sglang_peer

        sglang_peer._load()
        sglang_peer._resolve_silu(torch.device("cuda"))
        from moehal.integrations.sglang import peer_callable

        peer = peer_callable
    except Exception as exc:  # noqa: BLE001 - the peer is optional
        print(f"SGLang peer not available: {type(exc).__name__}: {exc}")
    dev = torch.device("cuda")
    cfg = moehal.MoEConfig(**SHAPES[a.shape], max_tokens=a.max_tokens)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
    w2 = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g) / cfg.intermediate_size**0.5
    layer = moehal.MoELayer(cfg, a.quant, device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13.to(dev), w2.to(dev)))
    call = peer(cfg, w13, w2, dev) if peer is not None and a.quant == "bf16" else None
    name = layer.plan.pipeline.name
    print(f"{torch.cuda.get_device_name()}: {a.shape} {a.quant} ({a.variant}), max_tokens {a.max_tokens}, {name}")
    for t in (int(x) for x in a.tokens.split(",")):
        x = torch.randn(t, cfg.hidden_size, generator=g).to(dev, cfg.dtype)
        ids = torch.rand(t, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].to(dev, torch.int32)
        wts = (torch.rand(t, cfg.top_k, generator=g) + 0.1).to(dev)
        report(f"moehal T={t}", trace(lambda x=x, ids=ids, wts=wts: layer(x, ids, wts), a.replays))
        if call is not None:
            report(f"sglang T={t}", trace(lambda x=x, ids=ids, wts=wts: call(x, ids, wts), a.replays))


if __name__ == "__main__":
    main()
