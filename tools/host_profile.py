"""Where the host time of one eager MoE forward goes (a diagnostic for #4's launch-overhead goal).

For each pipeline: host microseconds per stage (dispatch, experts, combine; kernels are only
queued, the GPU work is tiny at these token counts), then a cProfile of whole forwards sorted
by own time.   usage: python tools/host_profile.py [--tokens 16] [--calls 200] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import moehal
import torch
from moehal.bench import SHAPES, _pipeline_named
from moehal.quant import QuantScheme


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    sync()
    return us


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--pipelines", default="cuda.deepgemm:masked,cuda.deepgemm:contiguous,cuda.triton")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    dev = torch.device(a.device)
    reg = moehal.discover()
    quant = QuantScheme.parse(a.quant)
    for spec in a.pipelines.split(","):
        name, _, layout = spec.partition(":")
        cfg = moehal.MoEConfig(**SHAPES[a.shape], max_tokens=a.tokens if layout != "contiguous" else 4096)
        e, h = cfg.num_experts, cfg.hidden_size
        w13 = torch.randn(e, cfg.w13_rows, h, device=dev) / h**0.5
        w2 = torch.randn(e, h, cfg.intermediate_size, device=dev) / cfg.intermediate_size**0.5
        weights = moehal.quantize_weights(cfg, quant, w13, w2)
        pipe = _pipeline_named(name, cfg, quant, dev, reg)
        if layout:
            req = moehal.BuildRequest(cfg, quant, moehal.hardware.detect(dev), reg.settings)
            pipes, _ = moehal.enumerate_pipelines(req, reg, name.split(".")[0])
            pipe = next(q for q in pipes if q.main.qualname == name and q.fmt.layout_name == layout)
        layer = moehal.MoELayer(cfg, quant, device=dev, registry=reg, validate=False, pipeline=pipe)
        layer.load_weights(weights)
        profile_layer(layer, a.shape, a.tokens, a.quant, a.calls, a.top)


def profile_layer(layer: moehal.MoELayer, shape: str, tokens: int, quant: str, calls: int, top: int) -> None:
    cfg, dev = layer.config, layer.device
    x = torch.randn(tokens, cfg.hidden_size, device=dev, dtype=cfg.dtype)
    ids = torch.rand(tokens, cfg.num_experts, device=dev).argsort(dim=1)[:, : cfg.top_k].int()
    wts = torch.rand(tokens, cfg.top_k, device=dev)
    topk = moehal.routing.TopK(ids, wts)
    disp, exp = layer._dispatch, layer._experts
    d, hd = disp.dispatch(x, topk)
    y = exp.apply(d)
    print(f"== {shape} T={tokens} {quant} {layer.plan.pipeline.name}")
    # The stages run the pipeline's main format; a forward at a decode size may take its small-batch
    # format instead (session 52 read a one-token "experts" stage of the masked path as the forward's)
    print(
        f"host us/call: forward {per_call_us(lambda: layer(x, ids, wts), calls):.1f}; "
        f"stages in the {getattr(layer.plan.pipeline.fmt, 'layout_name', '?')} layout: "
        f"dispatch {per_call_us(lambda: disp.dispatch(x, topk), calls):.1f}, "
        f"experts {per_call_us(lambda: exp.apply(d), calls):.1f}, "
        f"combine {per_call_us(lambda: disp.combine(y, hd), calls):.1f}"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        layer(x, ids, wts)
    prof.disable()
    sync()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
