"""Would 64-row tails pay at prefill? (a diagnostic for #4's 1024-token roofline goal)

DeepGEMM's masked grouped GEMM runs one tile height per launch. At 1024 tokens an expert of
DeepSeek-V3's EP8 slice or Mixtral gets about 256 rows, so about half of them get a third
128-row tile that is mostly padding. This times, on the same 8 routings per cell:

- `one`: one launch, masked_m = the rows (what the layer does now);
- `split`: a launch on the whole 128-row tiles (masked_m = rows // 128 * 128) then one on the
  tails (rows % 128) in a separate `[E, 128, K]` buffer with 64-row tiles (hint 64);
- `split||`: the same with the tail launch on a second stream, beside the main one;
- `main`, `tail`: each launch alone.

    python tools/tail_split_probe.py [--shapes deepseek_v3_ep8,mixtral_8x7b] [--tokens 1024,2048]
        [--quant bf16,fp8_block]
"""

from __future__ import annotations

import argparse
import functools

import torch
from moehal.bench import SHAPES
from moehal_cuda.deepgemm_experts import DeepGemmOps
from moehal_cuda.tuning import ROTATIONS, Problem, routing_counts, time_graph

TILE = 128


def cell(
    ops: DeepGemmOps,
    prob: Problem,
    tail: Problem,
    side: torch.cuda.Stream,
    quant: str,
    shape: str,
    n: int,
    k: int,
    t: int,
    e: int,
    top_k: int,
    tail_hint: int,
) -> None:
    """Time one GEMM at one token count in each variant; print one line."""
    dev = torch.device("cuda")
    counts = [c.to(dev) for c in routing_counts(t, e, top_k, ROTATIONS, seed=t)]
    mains = [c // TILE * TILE for c in counts]
    tails = [c % TILE for c in counts]
    mean = max(1, -(-t * top_k // e))

    def main_only(c: torch.Tensor) -> None:
        prob.deepgemm(ops, c, mean)

    def tail_only(c: torch.Tensor) -> None:
        tail.deepgemm(ops, c, tail_hint)

    def split(mc: torch.Tensor, tc: torch.Tensor) -> None:
        main_only(mc)
        tail_only(tc)

    def split_par(mc: torch.Tensor, tc: torch.Tensor) -> None:
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            tail_only(tc)
        main_only(mc)
        cur.wait_stream(side)

    cells = {
        "one": time_graph([functools.partial(main_only, c) for c in counts]),
        "split": time_graph([functools.partial(split, m, tc) for m, tc in zip(mains, tails)]),
        "split||": time_graph([functools.partial(split_par, m, tc) for m, tc in zip(mains, tails)]),
        "main": time_graph([functools.partial(main_only, m) for m in mains]),
        "tail": time_graph([functools.partial(tail_only, tc) for tc in tails]),
    }
    flops = 2 * t * top_k * n * k
    hi = max(int(c.max()) for c in counts)
    text = "  ".join(f"{name}={us:7.1f}us/{flops / us / 1e6:5.0f}TF" for name, us in cells.items())
    gain = cells["one"] / min(cells["split"], cells["split||"])
    print(
        f"{quant:9s} {shape:16s} N={n:5d} K={k:5d} T={t:5d} mean={mean:4d} max={hi:4d}  {text}"
        f"  one/best-split={gain:.3f}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1024,2048")
    p.add_argument("--quant", default="bf16,fp8_block")
    p.add_argument("--tail-hint", type=int, default=64)
    a = p.parse_args()
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    tokens = [int(t) for t in a.tokens.split(",")]
    for quant in a.quant.split(","):
        fp8 = quant == "fp8_block"
        ops = DeepGemmOps(fp8, False, replay_graphs=False)
        for shape in a.shapes.split(","):
            s = SHAPES[shape]
            e, h, i, top_k = s["num_experts"], s["hidden_size"], s["intermediate_size"], s["top_k"]
            for n, k in ((2 * i, h), (h, i)):
                prob = Problem(e, n, k, max(tokens), fp8, dev)
                tail = Problem(e, n, k, TILE, fp8, dev)
                for t in tokens:
                    cell(ops, prob, tail, side, quant, shape, n, k, t, e, top_k, a.tail_hint)
                del prob, tail
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
