"""FP8 block-scale decode: the token-major kernels on fp8 weights against the grouped (masked)
path, in one process, the variants taking turns round by round, on `moehal bench`'s weights
and routing; the bf16 layer (its default path) beside them. Each row is timed as `moehal
bench` times one (CUDA-graph replays, after a settle period of the same work), and checked
against the reference backend on the same inputs (relative L2 error).

    python3 tools/fp8_decode_ab.py [--shapes qwen3_30b_a3b] [--tokens 1,2,4,8] [--rounds 3]

Variants: `fp8 masked` (`DeepGemmExperts.small_batch_max_tokens = 0`: no token-major batches),
`fp8 token` (= 8: every row here token-major, whatever the layer's rule would pick), `bf16`
(the layer's default).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch


def build(shape: str, quant: str, small: int | None, dev: torch.device) -> tuple:
    """A `cuda` layer of a bench shape and scheme, with the experts' decode range forced to
    `small` tokens (None: the rule), its weights the benchmark's."""
    import moehal
    from moehal.bench import SHAPES, _weights
    from moehal_cuda.deepgemm_experts import DeepGemmExperts

    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=4096)
    q = moehal.QuantScheme.parse(quant)
    _, _, weights = _weights(shape, cfg, q, dev)
    before = DeepGemmExperts.small_batch_max_tokens
    DeepGemmExperts.small_batch_max_tokens = small
    try:
        layer = moehal.MoELayer(cfg, q, backend="cuda", device=dev, validate=False)
    finally:
        DeepGemmExperts.small_batch_max_tokens = before
    layer.load_weights(weights)
    return cfg, q, weights, layer


def main() -> None:
    from moehal.bench import GRAPH_REPLAYS_PER_SAMPLE, _graphed, bench_inputs, release_layers, time_call
    from moehal.reference.oracle import reference_layer

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in a.shapes.split(","):
        variants = {
            "fp8 masked": build(shape, "fp8_block", 0, dev),
            "fp8 token": build(shape, "fp8_block", 8, dev),
            "bf16": build(shape, "bf16", None, dev),
        }
        cfg = variants["bf16"][0]
        oracle = reference_layer(cfg, "fp8_block", dev, validate=False)
        oracle.load_weights(variants["fp8 token"][2])
        for name, (_, _, _, layer) in variants.items():
            print(f"  {shape} {name}: {layer.plan.pipeline.name}")
        for t in map(int, a.tokens.split(",")):
            x, ids, wts = bench_inputs(cfg, t)
            xd, ids, wts = x.to(dev, cfg.dtype), ids.to(dev, torch.int32), wts.to(dev)
            ref = oracle(xd, ids, wts).float()
            errs = {}
            for name, (_, _, _, layer) in variants.items():
                if name.startswith("fp8"):
                    y = layer(xd, ids, wts).float()
                    errs[name] = ((y - ref).norm() / ref.norm()).item()
            fns = {name: _graphed(functools.partial(v[3], xd, ids, wts)) for name, v in variants.items()}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(a.rounds):
                for name, fn in fns.items():
                    us = time_call(fn, dev, a.reps, warmup_s=a.settle_s, per_sample=GRAPH_REPLAYS_PER_SAMPLE) * 1e6
                    times[name].append(us)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            cells = "  ".join(f"{name} {us:8.2f}" for name, us in med.items())
            ratio = med["fp8 masked"] / med["fp8 token"]
            err = "  ".join(f"{name} {e:.2e}" for name, e in errs.items())
            print(f"{shape} T={t}: us {cells}   masked/token {ratio:.3f}   rel L2 vs reference: {err}")
            print(f"    rounds: {', '.join(f'{n} ' + '/'.join(f'{u:.1f}' for u in ts) for n, ts in times.items())}")
        del variants, oracle
        release_layers(dev)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
