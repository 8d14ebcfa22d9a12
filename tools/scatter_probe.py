"""The dispatch scatter alone, into a masked destination and into a contiguous one, on a GPU (a
diagnostic for #4: session 32 traced Qwen3-30B-A3B's fp8 scatter at 4096 tokens at 72.7 us into
a contiguous buffer built for 16384 tokens, against about 30 us into a masked one).

Each variant binds `triton_permute.bind_permute` as the dispatcher does and times 10 calls
(the positions pass included) captured in one CUDA graph, replayed back to back. Variants:
  masked            [E, max_m, H] sized for the batch, as `moehal bench` builds its layers
  contiguous        rows of a buffer sized for `--max-tokens`, as an engine's layer
  contiguous-slots  the same, its row-bookkeeping programs dropped (row experts, segment starts
                    and stale rows are then not written: a timing only)
  contiguous-cap    a buffer sized for this batch alone (capacity = the call's rows)
  *-slotwise        with TOKEN_ROWS off: every slot loads and quantizes its token's row

    python3 tools/scatter_probe.py [--shape qwen3_30b_a3b] [--tokens 4096] [--quant fp8_block,bf16]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from scatter_scale_probe import graph_us  # tools/ is this script's directory


def main() -> None:
    import moehal
    from moehal.bench import SHAPES
    from moehal.kernels import triton_permute as tp

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="4096")
    p.add_argument("--quant", default="fp8_block,bf16")
    p.add_argument("--max-tokens", type=int, default=16384)
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg = moehal.MoEConfig(**SHAPES[a.shape])
    e, k, h = cfg.num_local_experts, cfg.top_k, cfg.hidden_size
    for t in map(int, a.tokens.split(",")):
        g = torch.Generator(dev).manual_seed(t)
        x = torch.randn(t, h, generator=g, device=dev).to(cfg.dtype)
        ids = torch.rand(t, e, generator=g, device=dev).argsort(dim=1)[:, :k].int()
        w = torch.rand(t, k, generator=g, device=dev)
        for q in a.quant.split(","):
            quant = q != "bf16"
            dt = torch.float8_e4m3fn if quant else cfg.dtype
            rows = tp.contiguous_rows(t * k, e, 128)
            cap = tp.contiguous_rows(a.max_tokens * k, e, 128)
            dests = {
                "masked": (tp.workspace("probe.m", (e, tp.masked_rows(t, 64)), h, dt, dev, quant), True, 64),
                "contiguous": (tp.contiguous_workspace("probe.c", rows, cap, h, dt, dev, quant), False, 128),
                "contiguous-cap": (tp.contiguous_workspace("probe.cc", rows, rows, h, dt, dev, quant), False, 128),
            }
            for name, (dest, masked, align) in dests.items():
                bound = tp.bind_permute(
                    t, k, h, dest, expert_start=0, num_local_experts=e, masked=masked, alignment=align
                )
                variants = {name: bound}
                slotwise = dataclasses.replace(bound, kw={**bound.kw, "TOKEN_ROWS": False})
                variants[f"{name}-slotwise"] = slotwise
                if name == "contiguous":
                    n_slot = bound.scalars[4]
                    variants["contiguous-slots"] = dataclasses.replace(bound, grid=(n_slot,))
                for vname, b in variants.items():
                    us = graph_us(lambda b=b, x=x, ids=ids, w=w: b(x, ids, w), reps=10, rounds=20)
                    rule = f"grid {b.grid[0]}, TOKEN_ROWS={b.kw['TOKEN_ROWS']}"
                    print(f"{a.shape} {q} T={t} {vname:22s} {us:8.1f} us  ({rule})")
                tp.release_workspaces(dev)


if __name__ == "__main__":
    main()
