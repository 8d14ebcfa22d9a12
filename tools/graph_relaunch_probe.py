"""Does relaunching one CUDA graph while it is still in flight cost the host more than launching
as many different graphs? (a diagnostic for #4's "host overhead under 20 us" with graphs)

`moehal bench`'s back-to-back host column (`host_time_back_to_back`) queues 8 calls of one
layer. With graphs on, that relaunches one graph exec 8 times while its earlier launches still
run. An engine's step queues each of its layers once: distinct graphs. The H200 rows that
missed 20 us back to back were the long ones (DeepSeek-V3 at 8-128 tokens, Mixtral at 8 and 128:
0.8-1 ms of GPU time each), while short rows met it. This probe times both ways, interleaved:

- raw graphs of `torch.cuda._sleep` (1 or 6 kernel nodes, 5 to 1000 us of GPU time);
- moehal layers replayed with `out=`: one layer 8 times, against 8 layers (sharing one set of
  weights) once each, as an engine's step queues them.

    python tools/graph_relaunch_probe.py [--shapes deepseek_v3_ep8,qwen3_30b_a3b] [--tokens 1,8,128]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

QUEUED = 8


def queued_us(calls: Sequence[Callable[[], Any]]) -> float:
    """Host us per call of `calls` made back to back from an idle GPU (one sample)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in calls:
        c()
    dt = (time.perf_counter() - t0) / len(calls)
    torch.cuda.synchronize()
    return dt * 1e6


def interleaved(modes: dict[str, Sequence[Callable[[], Any]]], rounds: int = 60) -> dict[str, float]:
    """Median host us per call of each mode's call list, the modes taking turns each round in
    a rotating order (a host's times drift between separate measurements)."""
    names = list(modes)
    for n in names:  # warm-up
        queued_us(modes[n])
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            samples[n].append(queued_us(modes[n]))
    return {n: statistics.median(v) for n, v in samples.items()}


def cycles_per_us() -> float:
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def sleep_graph(cycles: int, nodes: int) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for _ in range(nodes):
                torch.cuda._sleep(cycles // nodes)
    torch.cuda.synchronize()
    return g


def raw(report: Callable[[str, dict[str, float]], None]) -> None:
    cpu = cycles_per_us()
    for gpu_us in (5, 300, 1000):
        for nodes in (1, 6):
            graphs = [sleep_graph(int(gpu_us * cpu), nodes) for _ in range(QUEUED)]
            res = interleaved(
                {
                    "one graph x8": [graphs[0].replay] * QUEUED,
                    "8 graphs x1": [g.replay for g in graphs],
                }
            )
            report(f"sleep graph, {nodes} node(s), {gpu_us} us of GPU time", res)


def layers(shapes: list[str], tokens: list[int], report: Callable[[str, dict[str, float]], None]) -> None:
    import moehal
    from moehal.bench import SHAPES, bench_inputs, release_layers

    dev = torch.device("cuda")
    for shape in shapes:
        for t in tokens:
            cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max(t, 256))
            w13 = torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, device=dev) / cfg.hidden_size**0.5
            w2 = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, device=dev)
            w2 /= cfg.intermediate_size**0.5
            weights = moehal.quantize_weights(cfg, moehal.QuantScheme.parse("bf16"), w13, w2)
            del w13, w2
            x, ids, wts = bench_inputs(cfg, t)
            x, ids, wts = x.to(dev, cfg.dtype), ids.to(dev, torch.int32), wts.to(dev)
            built = []
            for _ in range(QUEUED):
                layer = moehal.MoELayer(cfg, "bf16", device=dev, validate=False)
                layer.load_weights(weights)
                layer.cuda_graph_tokens = t
                out = torch.empty_like(x)
                layer(x, ids, wts, out=out)  # capture
                built.append((layer, out))
            torch.cuda.synchronize()
            calls = [functools.partial(lay, x, ids, wts, out=o) for lay, o in built]
            res = interleaved({"one layer x8": [calls[0]] * QUEUED, "8 layers x1": calls})
            report(f"{shape} T={t} bf16 ({built[0][0].plan.pipeline.name}), replay with out=", res)
            del built, calls, weights
            release_layers(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="deepseek_v3_ep8,mixtral_8x7b,qwen3_30b_a3b")
    ap.add_argument("--tokens", default="1,8,128")
    ap.add_argument("--no-raw", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)

    def report(what: str, res: dict[str, float]) -> None:
        print(f"{what}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()), flush=True)

    if not args.no_raw:
        raw(report)
    layers(args.shapes.split(","), [int(t) for t in args.tokens.split(",")], report)


if __name__ == "__main__":
    main()
