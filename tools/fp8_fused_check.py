"""The FP8 fused GEMM1 + activation against the unfused path on a GPU, call after call (a
diagnostic for #4): `moehal bench`'s weights, fresh routings at every call, each batch run by
both paths in eager calls and in CUDA-graph replays. The split tiles (N tiles narrower than a
1x128 group, whose programs meet through an arrival counter to quantize it) would show a race
as a call that differs from the unfused path, or a replay that differs from its first output.

    python3 tools/fp8_fused_check.py [--shapes qwen3_30b_a3b] [--tokens 1,2,4,8,16] [--calls 200]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import moehal
    from moehal.bench import SHAPES, _weights
    from moehal.quant import QuantScheme
    from moehal_cuda.deepgemm_experts import DeepGemmExpertsRunner

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--quant", default="fp8_block")
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    dev = torch.device("cuda")
    quant = QuantScheme.parse(a.quant)
    shipped = DeepGemmExpertsRunner.fuse_fp8_gemm1_activation
    for shape in a.shapes.split(","):
        for t in map(int, a.tokens.split(",")):
            cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=t)
            _, _, weights = _weights(shape, cfg, quant, dev)
            layers = {}
            for fused in (False, True):
                DeepGemmExpertsRunner.fuse_fp8_gemm1_activation = fused
                layer = moehal.MoELayer(cfg, quant, backend="cuda", device=dev, validate=False)
                layer.load_weights(weights)
                layers[fused] = layer
            runner = layers[True]._experts
            gen = torch.Generator(dev).manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, generator=gen, device=dev).to(cfg.dtype)
            w = torch.rand(t, cfg.top_k, generator=gen, device=dev) + 0.1
            ids = torch.empty(t, cfg.top_k, dtype=torch.int32, device=dev)
            diff = 0
            worst = 0.0
            for _ in range(a.calls):
                ids.copy_(torch.rand(t, cfg.num_experts, generator=gen, device=dev).argsort(dim=1)[:, : cfg.top_k])
                want, got = layers[False](x, ids, w), layers[True](x, ids, w)
                if not torch.equal(want, got):
                    diff += 1
                    worst = max(worst, ((got.float() - want.float()).norm() / want.float().norm()).item())
            fused_bounds = [b for b, g in runner._masked.items() if g[2] is not None]
            # replays of one captured fused forward: every replay gives the first one's bits
            graph = torch.cuda.CUDAGraph()
            layers[True](x, ids, w)
            with torch.cuda.graph(graph):
                out = layers[True](x, ids, w)
            graph.replay()
            first = out.clone()
            unstable = 0
            for _ in range(a.calls):
                graph.replay()
                unstable += not torch.equal(out, first)
            torch.cuda.synchronize()
            print(
                f"{shape} {a.quant} T={t}: fused bounds {fused_bounds}; {diff}/{a.calls} eager calls differ from the "
                f"unfused path (worst rel L2 {worst:.2e}); {unstable}/{a.calls} replays differ from the first"
            )
    DeepGemmExpertsRunner.fuse_fp8_gemm1_activation = shipped


if __name__ == "__main__":
    main()
