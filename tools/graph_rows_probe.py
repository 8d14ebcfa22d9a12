"""GPU memory that `cuda_graph_tokens` holds per layer, one graph per token count.

    python tools/graph_rows_probe.py [--tokens 256] [--hidden 7168] [--experts 32]

Builds one bf16 `cuda` layer (DeepSeek-V3's EP8 slice by default: 32 experts, hidden 7168,
intermediate 2048, top-8), turns on graphs for every count up to --tokens, and calls it once
at each count with new tensors (the copying graphs), then again at each count on persistent
tensors (the direct graphs). Prints the graphs captured and the memory allocated after each
pass, beside what graphs with inputs and an output of their own would hold (sum of T rows),
and checks a few counts against an eager layer on the same weights.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    a = ap.parse_args()
    import moehal

    cfg = moehal.MoEConfig(a.experts, a.top_k, a.hidden, a.inter, max_tokens=a.tokens)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(a.experts, cfg.w13_rows, a.hidden, device="cuda", generator=g).mul_(a.hidden**-0.5).bfloat16()
    w2 = torch.randn(a.experts, a.hidden, a.inter, device="cuda", generator=g).mul_(a.inter**-0.5).bfloat16()
    layer = moehal.MoELayer(cfg, "bf16", backend="cuda", device="cuda", cuda_graph_tokens=a.tokens)
    eager = moehal.MoELayer(cfg, "bf16", backend="cuda", device="cuda")
    for m in (layer, eager):
        m.load_weights(w13=w13, w2=w2)
    print("pipeline", layer.plan.pipeline.name)

    def inputs(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(t, a.hidden, device="cuda", generator=gen).bfloat16()
        w, ids = torch.rand(t, a.experts, device="cuda", generator=gen).topk(a.top_k, dim=-1)
        return x, ids.int(), (w / w.sum(-1, keepdim=True)).float()

    x, ids, w = inputs(1, 0)
    layer(x, ids, w), eager(x, ids, w)  # workspaces, JIT
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    worst = 0.0
    for t in range(1, a.tokens + 1):  # new tensors each call: the copying graphs
        x, ids, w = inputs(t, t)
        y = layer(x, ids, w)
        if t in (1, 7, a.tokens // 2, a.tokens):
            ref = eager(x, ids, w)
            worst = max(worst, ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
        del x, ids, w, y
    torch.cuda.synchronize()
    copying = torch.cuda.memory_allocated() - base
    kept = {t: inputs(t, 10_000 + t) for t in range(1, a.tokens + 1)}
    for _ in range(3):  # the same tensors call after call: the direct graphs
        for x, ids, w in kept.values():
            layer(x, ids, w)
    torch.cuda.synchronize()
    inputs_bytes = sum(sum(v.numel() * v.element_size() for v in ts) for ts in kept.values())
    direct = torch.cuda.memory_allocated() - base - copying - inputs_bytes
    rows = a.tokens * (a.tokens + 1) // 2
    own = rows * (2 * a.hidden * 2 + a.top_k * 8)  # each graph's own inputs and output
    g_topk = layer._graphs_topk
    print(f"graphs: {len(g_topk._graphs)} copying, {g_topk.direct_graphs} direct")
    print(f"after the copying graphs: {copying / 2**20:.1f} MiB allocated by the graphs")
    print(f"after the direct graphs: {direct / 2**20:.1f} MiB more (the callers' own inputs excluded)")
    print(f"graphs with inputs and an output of their own would hold at least {own / 2**20:.1f} MiB")
    print(f"max relative difference from the eager layer at 4 counts: {worst:.2e}")
    assert worst < 1e-2, worst


if __name__ == "__main__":
    main()
