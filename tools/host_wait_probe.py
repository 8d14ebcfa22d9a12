"""Does a forward's host time depend on how long the host waited before it? (#4's host goal)

`moehal.bench.host_time` times each call from an idle GPU: synchronize, then the call. The
graph-replay rows it measured on H100 hosts grew with the row's GPU time (Qwen3-30B-A3B, one
replay with `out=`: 8.3 us at 1 token, 27.7 us at 128; DeepSeek-V3 at 8 tokens 26.4 us),
although a replay runs the same Python at every token count. Two readings: the call's own
cost grows with the graph (more nodes, larger kernels), or the host runs the call slower after
it waited longer in `synchronize` (a CPU that idled or migrated while the GPU worked). This
probe separates them:

- the floor: one 1-kernel graph replay, timed after the host waited D us in synchronize
  (a GPU sleep of D us enqueued first), for D from 0 to 3000;
- each layer row (graph replay with `out=`, and a plain eager forward), timed from idle (the
  bench's method), right after a GPU sleep is enqueued (the GPU busy while the call queues, the
  host not having waited), and back to back (8 calls queued, per call: an engine's loop);
- the Python calls one replayed forward makes (cProfile), to show which path it took.

    python tools/host_wait_probe.py [--shapes ...] [--tokens 1,8,16,128]
"""

from __future__ import annotations

import argparse
import pstats
from collections.abc import Callable
from typing import Any

import torch
from host_floor import bench_layer, host_us, host_us_queued, profiled


def cycles_per_us() -> float:
    """The GPU's `torch.cuda._sleep` cycles per microsecond, measured with events."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 2_000_000
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / (start.elapsed_time(end) * 1e3)


def host_us_after_wait(fn: Callable[[], Any], cycles: int, calls: int = 200) -> float:
    """Median host us of one call made right after the host waited in synchronize for a GPU
    sleep of `cycles` (the host idles, or spins, as long as the GPU sleeps)."""
    return host_us(fn, calls, before_sync=(lambda: torch.cuda._sleep(cycles)) if cycles else None)


def host_us_gpu_busy(fn: Callable[[], Any], cycles: int, calls: int = 200) -> float:
    """Median host us of one call queued behind a GPU sleep of `cycles`: the host did not wait
    before it (synchronize returned at once), and the GPU is busy while the call queues."""
    return host_us(fn, calls, after_sync=lambda: torch.cuda._sleep(cycles))


def python_calls(fn: Callable[[], Any], calls: int = 50) -> float:
    """Python function calls per call of `fn` (cProfile): which path a forward took."""
    return pstats.Stats(profiled(fn, calls)).total_calls / calls


def floor(report: Callable[[str, float], None], per_us: float) -> None:
    a = torch.zeros(64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        a.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a.add_(1)
    for d in (0, 30, 100, 300, 1000, 3000):
        report(f"1-kernel graph replay, the host having waited {d} us", host_us_after_wait(g.replay, int(d * per_us)))
    report("1-kernel graph replay, GPU busy (300 us sleep queued)", host_us_gpu_busy(g.replay, int(300 * per_us)))
    report("1-kernel graph replay, back to back (per call, 8 queued)", host_us_queued(g.replay, queued=8))


def layer_rows(shape: str, tokens: int, report: Callable[[str, float], None], per_us: float) -> None:
    layer, x, ids, wts = bench_layer(shape, tokens)
    out = torch.empty_like(x)
    tag = f"{shape} T={tokens}"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = lambda: layer(x, ids, wts)  # noqa: E731
    eager()
    start.record()
    for _ in range(10):
        eager()
    end.record()
    end.synchronize()
    gpu_us = start.elapsed_time(end) * 100  # per forward, back to back (eager: host-bound at decode)
    busy = int((gpu_us + 1000) * per_us)  # long enough to cover one eager call's host time
    print(f"{tag}: {layer.plan.pipeline.name}; eager forward {gpu_us:.1f} us of GPU-or-host time")
    report(f"{tag}: plain eager, from idle", host_us(eager))
    report(f"{tag}: plain eager, GPU busy", host_us_gpu_busy(eager, busy))
    report(f"{tag}: plain eager, back to back (per call, 8 queued)", host_us_queued(eager, queued=8))
    layer.cuda_graph_tokens = tokens
    replay = lambda: layer(x, ids, wts, out=out)  # noqa: E731
    for _ in range(5):
        replay()
    cache = layer._graphs_topk
    print(f"{tag}: direct graphs {cache.direct_graphs}, writing the output {cache.output_writing_graphs}")
    print(f"{tag}: Python calls per replayed forward: {python_calls(replay):.0f}")
    report(f"{tag}: replay with out=, from idle", host_us(replay))
    report(f"{tag}: replay with out=, GPU busy", host_us_gpu_busy(replay, busy))
    report(f"{tag}: replay with out=, back to back (per call, 8 queued)", host_us_queued(replay, queued=8))
    for d in (0, 300, 3000):
        report(f"{tag}: replay with out=, the host having waited {d} us", host_us_after_wait(replay, int(d * per_us)))
    cap = cache._direct.get(cache.where((x, ids, wts), out))
    if cap is not None:
        report(f"{tag}:   its CUDAGraph.replay() alone, from idle", host_us(cap.graph.replay))
        report(f"{tag}:   its CUDAGraph.replay() alone, GPU busy", host_us_gpu_busy(cap.graph.replay, busy))
        report(f"{tag}:   its CUDAGraph.replay() alone, the host having waited 3000 us",
               host_us_after_wait(cap.graph.replay, int(3000 * per_us)))  # fmt: skip
    layer.cuda_graph_tokens = 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1,8,16,128")
    a = p.parse_args()

    def report(what: str, us: float) -> None:
        print(f"{us:9.1f} us  {what}", flush=True)

    per_us = cycles_per_us()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU sleep: {per_us:.0f} cycles per us")
    floor(report, per_us)
    for shape in a.shapes.split(","):
        for t in a.tokens.split(","):
            layer_rows(shape, int(t), report, per_us)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
