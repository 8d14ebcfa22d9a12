"""Session 59: does `moehal bench` flatter moehal by replaying identical inputs?

The methodology review (finding 6) noted that every timed replay of a row sees the same
routing, and that moehal's masked dispatcher zeroes only the rows the previous call wrote and
this one does not (`triton_permute`): with one routing that work never happens, while a peer
without such state pays its full cost. This times one captured layer two ways, interleaved:
each replay preceded by copying routing A into the graph's inputs ("same"), or routings A and
B alternating ("alternating"; same copies, different ids). Rows as `moehal bench` builds them
(bf16, backend `cuda`, validate=False, max_tokens = the row's tokens).
    usage (GPU machine, moehal installed): python3 replay_inputs.py [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys

import moehal
import torch
from moehal import bench

dev = torch.device("cuda")
registry = moehal.discover()
quant = moehal.QuantScheme.parse("bf16")


def measure(shape: str, tokens: int) -> dict:
    cfg = moehal.MoEConfig(**bench.SHAPES[shape], max_tokens=tokens)
    _, _, weights = bench._weights(shape, cfg, quant, dev)
    layer = moehal.MoELayer(cfg, quant, backend="cuda", device=dev, registry=registry, validate=False)
    layer.load_weights(weights)
    x, ids_a, w_a = bench.bench_inputs(cfg, tokens)
    gen = torch.Generator().manual_seed(10_000 + tokens)
    ids_b = torch.rand(tokens, cfg.num_experts, generator=gen).argsort(dim=1)[:, : cfg.top_k]
    w_b = torch.rand(tokens, cfg.top_k, generator=gen) + 0.1
    xd = x.to(dev, cfg.dtype)
    src = [(ids_a.to(dev, torch.int32), w_a.to(dev)), (ids_b.to(dev, torch.int32), w_b.to(dev))]
    ids_s, w_s = src[0][0].clone(), src[0][1].clone()
    replay = bench._graphed(lambda: layer(xd, ids_s, w_s))
    turn = [0]

    def step(alternate: bool) -> None:
        i = turn[0] % 2 if alternate else 0
        turn[0] += 1
        ids_s.copy_(src[i][0])
        w_s.copy_(src[i][1])
        replay()

    times: dict[str, list[float]] = {"same": [], "alternating": []}
    for _ in range(3):  # interleaved rounds
        for name, alt in (("same", False), ("alternating", True)):
            t = bench.time_call(lambda a=alt: step(a), dev, reps=30, warmup_s=1.0, per_sample=10)
            times[name].append(t * 1e6)
    same, alt = statistics.median(times["same"]), statistics.median(times["alternating"])
    return dict(
        shape=shape,
        tokens=tokens,
        pipeline=layer.plan.pipeline.name,
        same_us=same,
        alternating_us=alt,
        ratio=alt / same,
        rounds=times,
    )


rows = []
cells = [("qwen3_30b_a3b", t) for t in (16, 128, 1024, 4096)]
cells += [(s, t) for s in ("deepseek_v3_ep8", "mixtral_8x7b") for t in (128, 4096)]
for shape, tokens in cells:
    r = measure(shape, tokens)
    rows.append(r)
    print(
        f"{shape:16s} {tokens:5d}  same {r['same_us']:9.1f} us  alternating {r['alternating_us']:9.1f} us"
        f"  x{r['ratio']:.3f}  {r['pipeline']}",
        flush=True,
    )
    bench.release_layers(dev)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
