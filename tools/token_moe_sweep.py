"""Decode path, measured: the token-major kernels (`moehal.kernels.triton_token_moe`) against the
masked path on the bench shapes, and their tiles. A device diagnostic for issue #4.

    python3 tools/token_moe_sweep.py [--shapes ...] [--tokens 1,2,4,8,16] [--tiles]

1. Whole layer (graph replay, 10 back to back, median of 20), the same layer once with and once
   without the small-batch format, at each token count.
2. --tiles: each kernel alone over a grid of tiles at 1 and 4 tokens (graph of 10 launches),
   beside the tile the layer would use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def layers(shape: str, dev: torch.device) -> tuple[Any, dict[str, Any]]:
    import moehal
    from moehal.bench import SHAPES, _weights

    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=4096)
    quant = moehal.QuantScheme.parse("bf16")
    _, _, weights = _weights(shape, cfg, quant, dev)
    req = moehal.BuildRequest(cfg, quant, moehal.detect(dev))
    pipes, _ = moehal.enumerate_pipelines(req, moehal.discover(), "cuda")
    best = next(p for p in pipes if p.main.qualname == "cuda.deepgemm")
    out = {}
    for name, pipe in (("token", best), ("masked", dataclasses.replace(best, small=None))):
        layer = moehal.MoELayer(cfg, quant, device=dev, validate=False, pipeline=pipe)
        layer.load_weights(weights)
        out[name] = layer
    return cfg, out


def routing(cfg: Any, t: int, dev: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + t)
    x = torch.randn(t, cfg.hidden_size, generator=g).to(dev, cfg.dtype)
    ids = torch.rand(t, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].to(dev, torch.int32)
    return x, ids, (torch.rand(t, cfg.top_k, generator=g) + 0.1).to(dev)


def graph_us(fn: Callable[[], Any]) -> float:
    from graph_trace import replay_us
    from moehal.graphs import capture

    graph, _ = capture(fn, torch.device("cuda"), warmup=2)
    return replay_us(graph)


def tiles(cfg: Any, layer: Any, dev: torch.device, tokens: int) -> dict:
    from moehal.kernels.tiles import TileConfig
    from moehal.kernels.triton_token_moe import token_gemm_act, token_gemm_combine
    from moehal_cuda.tuning import time_graph

    w = layer._experts.w
    x, ids, wts = routing(cfg, tokens, dev)
    act = torch.randn(tokens * cfg.top_k, cfg.intermediate_size, device=dev).to(cfg.dtype)
    out = torch.empty(tokens, cfg.hidden_size, device=dev, dtype=cfg.dtype)
    from moehal.kernels.triton_token_moe import combine_config, token_config

    used1 = token_config(cfg.intermediate_size, cfg.hidden_size)
    used2 = combine_config(cfg.hidden_size, cfg.intermediate_size)
    res: dict = {"tokens": tokens, "used_act": str(used1), "used_combine": str(used2)}

    def t1(cfg_: TileConfig | None) -> float:
        return time_graph([lambda: token_gemm_act(x, ids, w.w13, None, act, cfg_, activation=1, gated=True)] * 10)

    def t2(cfg_: TileConfig | None, split: int | None = None) -> float:
        return time_graph([lambda: token_gemm_combine(act, ids, wts, w.w2, None, out, cfg_, split=split)] * 10)

    res["act_used_us"] = t1(used1)
    res["combine_used_us"] = t2(used2)
    grid1, grid2 = [], []
    for bn in (16, 32, 64):
        for bk in (64, 128, 256):
            for warps, stages in ((4, 3), (4, 5), (2, 4), (8, 4)):
                c = TileConfig(16, bn, bk, 1, warps, stages)
                for split in (1, 2, 4):
                    if cfg.intermediate_size % bk or cfg.top_k % split or (warps, stages) == (8, 4):
                        continue
                    try:
                        grid2.append((t2(c, split), f"{c} split {split}"))
                    except Exception as exc:  # noqa: BLE001 - a tile that does not fit
                        grid2.append((float("inf"), f"{c} split {split}: {type(exc).__name__}"))
                if cfg.hidden_size % bk == 0 and bk <= 128:
                    try:
                        grid1.append((t1(c), str(c)))
                    except Exception as exc:  # noqa: BLE001
                        grid1.append((float("inf"), f"{c}: {type(exc).__name__}"))
    grid1.sort()
    grid2.sort()
    res["act_best"] = grid1[:5]
    res["combine_best"] = grid2[:5]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    ap.add_argument("--tokens", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--tiles", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    results = []
    for shape in a.shapes.split(","):
        t0 = time.monotonic()
        cfg, ls = layers(shape, dev)
        small = ls["token"].plan.pipeline.small
        print(f"== {shape}: small batch {small}", flush=True)
        if small is None:  # the layer runs masked at every size (deepgemm_experts.small_batch_tokens)
            continue
        print(f"  {'T':>4s} {'token-major':>12s} {'masked':>10s} {'ratio':>6s}")
        for t in (int(v) for v in a.tokens.split(",")):
            x, ids, wts = routing(cfg, t, dev)
            row = {"shape": shape, "tokens": t}
            for name, layer in ls.items():
                if name == "token":  # measure the token-major path past the rule's limit too
                    layer._small_tokens = max(t, small.max_tokens)
                row[name] = graph_us(lambda layer=layer, x=x, ids=ids, wts=wts: layer(x, ids, wts))
            ls["token"]._small_tokens = small.max_tokens
            print(
                f"  {t:4d} {row['token']:10.2f}us {row['masked']:8.2f}us {row['masked'] / row['token']:6.3f}x",
                flush=True,
            )
            results.append(row)
        if a.tiles:
            for t in (1, 4):
                r = tiles(cfg, ls["token"], dev, t)
                r["shape"] = shape
                print(f"  tiles at T={t}: act used {r['act_used_us']:.2f} us ({r['used_act']})")
                print(f"    best {r['act_best'][:3]}")
                print(f"    combine used {r['combine_used_us']:.2f} us ({r['used_combine']})")
                print(f"    best {r['combine_best'][:3]}", flush=True)
                results.append(r)
        print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
        del ls
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
