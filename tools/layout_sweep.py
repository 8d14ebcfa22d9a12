"""Prefill layouts, measured: the DeepGEMM experts on masked and on contiguous input, whole layer
(graph replay), with each GEMM's kernel time. A device diagnostic for issue #4's 1024-token rows.

    python3 tools/layout_sweep.py [--shapes ...] [--tokens 512,1024,2048,4096] [--quant bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import moehal
    from moehal.bench import SHAPES, _weights, kernel_breakdown
    from token_moe_sweep import graph_us, routing

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek_v3_ep8,mixtral_8x7b,qwen3_30b_a3b")
    ap.add_argument("--tokens", default="512,1024,2048,4096")
    ap.add_argument("--quant", default="bf16")
    a = ap.parse_args()
    dev = torch.device("cuda")
    for shape in a.shapes.split(","):
        cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=4096)
        quant = moehal.QuantScheme.parse(a.quant)
        _, _, weights = _weights(shape, cfg, quant, dev)
        layers = {}
        for layout in ("masked", "contiguous"):
            layer = moehal.MoELayer(cfg, quant, device=dev, validate=False, layout=layout)
            layer.load_weights(weights)
            layers[layout] = layer
        print(f"== {shape} {a.quant}", flush=True)
        for t in (int(v) for v in a.tokens.split(",")):
            x, ids, wts = routing(cfg, t, dev)
            line = f"  T={t:5d}"
            for layout, layer in layers.items():
                call = lambda layer=layer, x=x, ids=ids, wts=wts: layer(x, ids, wts)  # noqa: E731
                us = graph_us(call)
                parts = kernel_breakdown(call, dev, top=4)
                top = ", ".join(f"{k[:28]} {v:.0f}" for k, v in parts.items())
                line += f" | {layout} {us:8.1f} us ({top})"
            print(line, flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
