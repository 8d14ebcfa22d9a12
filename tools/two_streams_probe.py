"""Two streams at once, with and without `moehal.stream_order` (session 38), on a GPU.

1. The race: conformance's `two_streams` cases of a backend run twice, first with the order
   switched off (`stream_order.ENABLED = False`: forwards queue on their streams unordered, as
   before session 38), then on. Off, the CUDA backend's layers of one shape share their scratch,
   and cases whose forwards overlap should fail; on, every case must pass.
2. The cost: host time of plain eager forwards (`moehal.bench.host_time_back_to_back`) of one
   layer with its order and without it (`layer._order = None`, as on a device without one), in
   interleaved rounds, at decode sizes of the benchmark shapes; and of the order alone.

    python tools/two_streams_probe.py [--backend cuda] [--cases qwen3_30b_a3b:1,mixtral_8x7b:1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import moehal
import torch
from moehal import stream_order
from moehal.bench import SHAPES, bench_inputs, host_time_back_to_back
from moehal_conformance.suite import Suite


def race(backend: str, dev: torch.device) -> bool:
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    results = {}
    for name, on in (("off", False), ("on", True)):
        stream_order.ENABLED = on
        suite = Suite(backend, reg, dev, profile="quick")
        suite.run([c for c in suite.cases() if c.check == "two_streams"])
        results[name] = {r.id: r for r in suite.results}
    stream_order.ENABLED = True
    print("| case | path | order off | order on |\n|---|---|---|---|")
    for cid, on in results["on"].items():
        off = results["off"][cid]
        detail = f"{off.status}: {off.detail}" if off.status == "fail" else off.status
        print(f"| {cid} | {on.pipeline} | {detail[:160]} | {on.status} |")
    failed_off = sum(r.status == "fail" for r in results["off"].values())
    failed_on = sum(r.status == "fail" for r in results["on"].values())
    n = len(results["on"])
    print(f"\norder off: {failed_off} of {n} cases failed; order on: {failed_on} of {n} failed")
    return failed_on == 0


def host_cost_one(shape: str, t: int, rounds: int, dev: torch.device) -> str:
    """One table row: medians of interleaved rounds, and of the per-round differences."""
    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max(t, 16))
    h, i = cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator(dev).manual_seed(0)
    w13 = torch.randn(cfg.num_experts, cfg.w13_rows, h, generator=gen, device=dev) / h**0.5
    w2 = torch.randn(cfg.num_experts, h, i, generator=gen, device=dev) / i**0.5
    layer = moehal.MoELayer(cfg, "bf16", device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13, w2))
    x, ids, wts = bench_inputs(cfg, t)
    x, ids, wts = x.to(dev, cfg.dtype), ids.to(dev, torch.int32), wts.to(dev)
    order = layer._order

    def ordered() -> torch.Tensor:
        layer._order = order
        return layer(x, ids, wts)

    def unordered() -> torch.Tensor:  # `MoELayer.forward` as on a device without an order
        layer._order = None
        return layer(x, ids, wts)

    fns = {"ordered": ordered, "unordered": unordered}
    switches = order.switches
    for fn in fns.values():  # binds, compiles, memo captures
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(host_time_back_to_back(fn, dev, rounds=20) * 1e6)
    layer._order = order
    switches = order.switches - switches  # 0: every timed call ran on the stream of the last
    a, b = statistics.median(times["ordered"]), statistics.median(times["unordered"])
    diffs = [x - y for x, y in zip(times["ordered"], times["unordered"], strict=True)]
    return (
        f"| {shape}:{t} | {layer.plan.pipeline.name} | {a:.1f} | {b:.1f} | "
        f"{statistics.median(diffs):+.2f} ({min(diffs):+.2f} to {max(diffs):+.2f}) | {switches} |"
    )


def order_alone(dev: torch.device, calls: int = 20000) -> str:
    """Host time of entering and leaving the order on the stream of the last forward."""
    order = stream_order.for_device(dev)
    with order:
        pass
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            with order:
                pass
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return f"entering and leaving the order alone: {statistics.median(samples):.3f} us (median of 5 x {calls})"


def host_cost(cases: list[tuple[str, int]], rounds: int, dev: torch.device) -> None:
    print("\n" + order_alone(dev))
    print("\n| case | path | ordered us | unordered us | ordered - unordered us | stream switches |")
    print("|---|---|---|---|---|---|")
    for shape, t in cases:
        print(host_cost_one(shape, t, rounds, dev))
        moehal.bench.release_layers(dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--cases", default="qwen3_30b_a3b:1,qwen3_30b_a3b:16,deepseek_v3_ep8:1,mixtral_8x7b:1")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--skip-race", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    ok = True if args.skip_race else race(args.backend, dev)
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",") if c]
    host_cost(cases, args.rounds, dev)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
