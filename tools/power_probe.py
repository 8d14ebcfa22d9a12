"""Power, clock and energy per forward of moehal's layer and SGLang's fused MoE, each replayed
back to back for a few seconds (a diagnostic for #4: under sustained prefill an H100 sits at
its power cap, so a path that needs fewer joules per forward keeps higher clocks).

    python3 tools/power_probe.py [--cases qwen3_30b_a3b:4096 deepseek_v3_ep8:1024] [--seconds 3]
        [--paths cuda,cuda.triton,sglang] [--rounds 2]

For each path: the forward captured into a CUDA graph, replayed for `--seconds` while
`moehal.clock_sampler` samples power and SM clock every 100 ms. The first half of the run settles the
clocks; the time per forward (CUDA events) and the medians of power and clock are taken over
the second half. Energy per forward = median power x time per forward. SGLang comes in through
`tools/sglang_peer.py` (its Triton fused MoE, bf16 only), on the same weights and routing.
With `--rounds N` the paths take turns (A B C A B C ...), so that an order effect (a path
measured right after a cooler one) shows as a difference between rounds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from moehal.clock_sampler import ClockSampler


def run_path(replay: Callable[[], Any], seconds: float, sampler: ClockSampler) -> tuple[float, float, float]:
    """(us per forward, median W, median MHz) over the second half of `seconds` of replays."""
    from moehal.bench import settle

    settle(replay, torch.device("cuda"), seconds / 2, batch=5)
    t0 = time.time()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 0
    start.record()
    while time.time() - t0 < seconds / 2:
        for _ in range(5):
            replay()
        n += 5
        end.record()
        end.synchronize()
    mhz, watts = sampler.medians(t0, time.time())
    return start.elapsed_time(end) * 1e3 / n, watts, mhz


def probe_case(
    shape: str, t: int, seconds: float, fp8: bool, sampler: ClockSampler, names: list[str], rounds: int
) -> None:
    """Each of `names` (a moehal backend like 'cuda', a pipeline like 'cuda.triton', or 'sglang')
    in bf16, and (fp8) the moehal ones in fp8_block, at one shape and token count."""
    import moehal
    from moehal.bench import SHAPES, _pipeline_named, _weights, bench_inputs
    from moehal.graphs import capture
    from moehal.integrations import sglang
    from moehal.quant import QuantScheme

    dev = torch.device("cuda")
    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=t)
    x, ids, wts = bench_inputs(cfg, t)  # the benchmark's routing for this row
    ids, wts = ids.to(dev, torch.int32), wts.to(dev)
    xd = x.to(dev, cfg.dtype)
    registry = moehal.discover()
    for q in ("bf16", "fp8_block") if fp8 else ("bf16",):
        quant = QuantScheme.parse(q)
        w13, w2, weights = _weights(shape, cfg, quant, dev)
        graphs = []
        for name in names:
            if name == "sglang":
                if q != "bf16":  # SGLang's peer takes float weights only
                    continue
                call = sglang.peer_callable(cfg, w13, w2, dev)
                fn: Callable[[], Any] = lambda call=call: call(xd, ids, wts)
            else:
                pipe = _pipeline_named(name, cfg, quant, dev, registry) if "." in name else None
                layer = moehal.MoELayer(
                    cfg, q, backend=name.split(".")[0], device=dev, registry=registry, validate=False, pipeline=pipe
                )
                layer.load_weights(weights)
                fn = lambda layer=layer: layer(xd, ids, wts)
            graph, _ = capture(fn, dev, warmup=2)
            graphs.append((f"{name} {q}", graph))
        for r in range(rounds):
            for label, graph in graphs:
                us, watts, mhz = run_path(graph.replay, seconds, sampler)
                mj = watts * us / 1e3
                case = f"{shape}:{t}" + (f" r{r + 1}" if rounds > 1 else "")
                print(f"{case:28s} {label:22s} {us:9.1f} {watts:6.0f} {mhz:6.0f} {mj:7.1f}", flush=True)
        del graphs
        torch.cuda.empty_cache()


def main() -> None:
    import sglang_peer  # tools/ is this script's directory

    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["qwen3_30b_a3b:4096", "deepseek_v3_ep8:1024", "mixtral_8x7b:1024"])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="also moehal fp8_block")
    p.add_argument("--paths", default="cuda,sglang", help="comma list: moehal backends or pipelines, and sglang")
    p.add_argument("--rounds", type=int, default=1, help="the paths take turns this many times")
    a = p.parse_args()
    dev = torch.device("cuda")
    sglang_peer._load()
    sglang_peer._resolve_silu(dev)
    sampler = ClockSampler.start(dev)
    if sampler is None:
        raise SystemExit("no clock and power samples here (needs an NVIDIA GPU and nvidia-smi)")
    print(torch.cuda.get_device_name(), f"{a.seconds:g} s per path, medians over its second half")
    print(f"{'case':28s} {'path':22s} {'us/fwd':>9s} {'W':>6s} {'MHz':>6s} {'mJ/fwd':>7s}")
    try:
        for case in a.cases:
            shape, tokens = case.split(":")
            probe_case(shape, int(tokens), a.seconds, a.fp8, sampler, a.paths.split(","), a.rounds)
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
