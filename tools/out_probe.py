"""What an engine's `out=` buffer costs a replayed forward (#4's decode and host goals).

`layer(x, ids, w, out=buf)` with `cuda_graph_tokens` replays one graph. Up to session 17 that
graph ran the forward into the pipeline's own output and then copied it into `buf`: one more
kernel per forward. This probe captures, per row, the forward three ways on the same layer and
tensors and times each graph's replays:

- `no out`: the forward returning its own output (what `moehal bench`'s time column replays);
- `copy into out`: the forward, then `out.copy_(...)` (the `out=` graph before the change);
- `into out`: the forward writing `out` itself (`MoELayer._forward_topk(..., out=out)`), where
  the code has it.

For each: kernels per forward (torch.profiler over one eager call), GPU us per replay (8
replays queued back to back, median of 30 rounds, the variants taking turns), and the host us
of `CUDAGraph.replay()` alone, back to back.

    python tools/out_probe.py [--shapes ...] [--tokens 1,8,16,128]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from collections.abc import Callable
from typing import Any

import torch
from host_floor import bench_layer, host_us_queued


def kernels_per_call(fn: Callable[[], Any]) -> int:
    """GPU kernels (and memsets / copies) one call of `fn` launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def gpu_us(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int = 30, queued: int = 8) -> dict[str, float]:
    """Median GPU us per replay for each graph, `queued` replays back to back per sample, the
    graphs taking turns round by round."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queued):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / queued)
    return {k: statistics.median(v) for k, v in times.items()}


def row(shape: str, tokens: int) -> None:
    from moehal.graphs import capture

    dev = torch.device("cuda")
    layer, x, ids, wts = bench_layer(shape, tokens)
    out = torch.empty_like(x)
    fwd = layer._forward_topk
    calls: dict[str, Callable[[], Any]] = {
        "no out": lambda: fwd(x, ids, wts),
        "copy into out": lambda: out.copy_(fwd(x, ids, wts)),
    }
    if "out" in inspect.signature(fwd).parameters:
        calls["into out"] = lambda: fwd(x, ids, wts, out=out)
    ref = fwd(x, ids, wts).clone()
    graphs = {}
    for name, fn in calls.items():
        graphs[name], _ = capture(fn, dev)
    for name, g in graphs.items():
        if name != "no out":
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), f"{shape} T={tokens} {name}: differs from the forward's own output"
    per_gpu = gpu_us(graphs)
    tag = f"{shape} T={tokens} ({layer.plan.pipeline.name})"
    for name, fn in calls.items():
        k = kernels_per_call(fn)
        host = host_us_queued(graphs[name].replay, queued=8)
        print(f"{tag:60s} {name:14s} kernels {k:2d}  GPU {per_gpu[name]:8.2f} us/replay  "
              f"replay() host {host:6.2f} us (b2b)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1,8,16,128")
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in a.shapes.split(","):
        for t in a.tokens.split(","):
            row(shape, int(t))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
