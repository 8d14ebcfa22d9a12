"""Python host time of one eager `MoELayer` forward of the CUDA backend's pipelines, on any CPU:
the layer built through the test suite's `cudacpu` registry (cuda.permute and the DeepGEMM /
NVFP4-on-Hopper experts with their CPU stand-ins, `tests/layer_fuzz.py`), every Triton kernel
stubbed out. A diagnostic for #4's host-overhead goal that covers the layer's own per-call code
too (`tools/host_python.py` times the runners alone, bf16 only).

What it leaves out: the launcher's own cost per launch on a device host (about 7-11 us on the
H100 and H200 hosts, `tools/host_floor.py`), and anything only a GPU does. Session 51 measured
an eager one-token NVFP4 step at 94 us of host time on an H200 host, against bf16's 45, while
this harness gave 24 and 19 us of Python with one launch more: see
docs/device-runs/2026-11-28-session51/README.md. Session 52 measured both in one process on an
H200 host (58.7 and 60.3 us back to back): the 94 us was the spread of one-call timings.

    python tools/host_layer_cpu.py [--shape qwen3_30b_a3b] [--quants bf16,nvfp4] [--tokens 1,4] [--profile]
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates moehal's kernels

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton.runtime.interpreter as interpreter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--quants", default="bf16,nvfp4")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import moehal
    from layer_fuzz import _cuda_cpu_registry
    from moehal.bench import SHAPES

    reg = _cuda_cpu_registry()
    for quant in a.quants.split(","):
        cfg = moehal.MoEConfig(**SHAPES[a.shape], max_tokens=4096)
        g = torch.Generator().manual_seed(0)
        e = cfg.num_experts
        w13 = torch.randn(e, cfg.w13_rows, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
        w2 = torch.randn(e, cfg.hidden_size, cfg.intermediate_size, generator=g) / cfg.intermediate_size**0.5
        layer = moehal.MoELayer(cfg, quant, "cudacpu", device="cpu", registry=reg, validate=False)
        layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13, w2))
        real = interpreter.InterpretedFunction.run
        interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None  # every kernel: a no-op
        try:
            for t in map(int, a.tokens.split(",")):
                x = torch.randn(t, cfg.hidden_size, generator=g).to(cfg.dtype)
                ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, : cfg.top_k].int()
                wts = torch.rand(t, cfg.top_k, generator=g)
                for _ in range(100):  # binds, pins
                    layer(x, ids, wts)
                rounds = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        layer(x, ids, wts)
                    rounds.append((time.perf_counter() - t0) / a.calls * 1e6)
                print(f"{a.shape} {quant} T={t}: {statistics.median(rounds):.1f} us per forward "
                      f"({layer.plan.pipeline.name})")  # fmt: skip
                if a.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(a.calls):
                        layer(x, ids, wts)
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
                    print(out.getvalue())
        finally:
            interpreter.InterpretedFunction.run = real


if __name__ == "__main__":
    main()
