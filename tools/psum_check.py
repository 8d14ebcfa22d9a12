"""DeepGEMM's contiguous GEMMs given the segments' ends (`use_psum_layout`) against the same
layers given the row-to-expert map only, on a GPU, call after call (a diagnostic for #4): the
benchmark's weights, layers built for `--max-tokens` so that they take the contiguous layout,
fresh routings at every call. Each call's two outputs are compared bit for bit; rows differ
only if DeepGEMM tiles the two layouts differently.

    python3 tools/psum_check.py [--shapes qwen3_30b_a3b] [--quants bf16,fp8_block] [--tokens 8,1024,4096]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import moehal
    from moehal.bench import SHAPES, _weights
    from moehal.formats import Layout
    from moehal.quant import QuantScheme
    from moehal_cuda.deepgemm_experts import DeepGemmOps

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--quants", default="bf16,fp8_block")
    p.add_argument("--tokens", default="8,100,1024,4096")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda")
    for shape in a.shapes.split(","):
        for q in a.quants.split(","):
            quant = QuantScheme.parse(q)
            cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=a.max_tokens)
            _, _, weights = _weights(shape, cfg, quant, dev)
            layers = {}
            for psum in (False, True):
                DeepGemmOps.psum_layout = psum
                layer = moehal.MoELayer(cfg, quant, backend="cuda", device=dev, validate=False)
                layer.load_weights(weights)
                layers[psum] = layer
            DeepGemmOps.psum_layout = True
            runner = layers[True]._experts
            layout = runner.fmt.layout
            if layout is not Layout.CONTIGUOUS:
                print(f"{shape} {q}: the layer takes the {layout.value} layout, not contiguous: nothing to compare")
                continue
            print(f"{shape} {q}: takes_psum={runner.ops.takes_psum} (off: {layers[False]._experts.ops.takes_psum})")
            for t in map(int, a.tokens.split(",")):
                gen = torch.Generator(dev).manual_seed(t)
                x = torch.randn(t, cfg.hidden_size, generator=gen, device=dev).to(cfg.dtype)
                w = torch.rand(t, cfg.top_k, generator=gen, device=dev) + 0.1
                diff, worst = 0, 0.0
                for _ in range(a.calls):
                    ids = torch.rand(t, cfg.num_experts, generator=gen, device=dev).argsort(dim=1)[:, : cfg.top_k]
                    want, got = layers[False](x, ids.int(), w), layers[True](x, ids.int(), w)
                    if not torch.equal(want, got):
                        diff += 1
                        worst = max(worst, ((got.float() - want.float()).norm() / want.float().norm()).item())
                torch.cuda.synchronize()
                print(f"  T={t}: {diff}/{a.calls} calls differ (worst rel L2 {worst:.2e})")


if __name__ == "__main__":
    main()
