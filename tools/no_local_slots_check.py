"""An expert-parallel rank whose batch has no slot for its experts, on a GPU (a diagnostic for #4).

The contiguous layout then has rows (sized on the host from the slot count) and no segments,
so DeepGEMM's psum path gets segment ends that are all 0. Conformance's
`shapes/bf16/no_local_slots` runs this at its small base shape, where DeepGEMM's FP8 GEMMs
decline. This runs the bf16 and fp8 layers of a Qwen3-like slice, restricted to the contiguous
layout: each call with no local slot must return zeros, and a
call with local slots after them must equal a fresh layer's output bit for bit (no stale rows,
a live context).

    python3 tools/no_local_slots_check.py [--quants bf16,fp8_block] [--tokens 1,9,300,4096]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import moehal
    from moehal.formats import Layout
    from moehal.quant import QuantScheme

    p = argparse.ArgumentParser()
    p.add_argument("--quants", default="bf16,fp8_block")
    p.add_argument("--tokens", default="1,9,300,4096")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda")
    # rank 1 of 2 owns experts 16-31 of 32
    cfg = moehal.MoEConfig(
        num_experts=32, top_k=8, hidden_size=2048, intermediate_size=768, ep_size=2, ep_rank=1, max_tokens=a.max_tokens
    )
    gen = torch.Generator(dev).manual_seed(0)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(e, cfg.w13_rows, h, generator=gen, device=dev) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen, device=dev) / i**0.5
    for q in a.quants.split(","):
        quant = QuantScheme.parse(q)
        weights = moehal.quantize_weights(cfg, quant, w13, w2, calibration_input=torch.randn(64, h, device=dev))
        layer = moehal.MoELayer(cfg, quant, backend="cuda", device=dev, validate=False, layout="contiguous")
        layer.load_weights(weights)
        runner = layer._experts
        layout = runner.fmt.layout if runner is not None else None
        takes_psum = getattr(getattr(runner, "ops", None), "takes_psum", None)
        print(f"{q}: {layer.plan.pipeline.name}, layout {layout}, takes_psum={takes_psum}")
        if layout is not Layout.CONTIGUOUS:
            print("  not the contiguous layout: nothing to check")
            continue
        for t in map(int, a.tokens.split(",")):
            x = torch.randn(t, h, generator=gen, device=dev).to(cfg.dtype)
            w = torch.rand(t, cfg.top_k, generator=gen, device=dev) + 0.1
            nonzero = 0
            for _ in range(a.calls):
                other = torch.rand(t, 16, generator=gen, device=dev).argsort(dim=1)[:, : cfg.top_k]  # experts 0-15
                # the forward (a small batch may take a small-batch format), then the main format
                y = layer(x, other.int(), w)
                y_main = layer.trace(x, other.int(), w, path="main")["out"]
                torch.cuda.synchronize()
                nonzero += int(y.count_nonzero().item() != 0 or y_main.count_nonzero().item() != 0)
            ids = torch.rand(t, 32, generator=gen, device=dev).argsort(dim=1)[:, : cfg.top_k]
            got = layer(x, ids.int(), w)
            fresh = moehal.MoELayer(cfg, quant, backend="cuda", device=dev, validate=False, layout="contiguous")
            fresh.load_weights(weights)
            want = fresh(x, ids.int(), w)
            torch.cuda.synchronize()
            print(
                f"  T={t}: {a.calls - nonzero}/{a.calls} no-local calls all zeros (forward and main format); "
                f"then a routed call {'equals' if torch.equal(got, want) else 'DIFFERS FROM'} a fresh layer's"
            )


if __name__ == "__main__":
    main()
