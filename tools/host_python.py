"""Python host time of one eager `cuda.permute -> cuda.deepgemm` forward, on any CPU, with every
kernel stubbed out (a diagnostic for #4's "host overhead under 20 us per forward outside graphs").

What it measures: dispatch, the experts' apply and the combine as an eager decode step runs
them, with the Triton kernels (interpreted, so no GPU is needed) and DeepGEMM replaced by
no-ops. So the numbers are the Python that prepares the launches, not the launches: on a
device host add the launcher's own cost per launch (`tools/host_floor.py`). GEMMs are chosen
from a shipped tuned table (`--table`, by device name), as on that GPU.

    python tools/host_python.py [--shape qwen3_30b_a3b] [--tokens 1,16] [--path masked|token] [--profile]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates moehal's kernels

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import triton.runtime.interpreter as interpreter


def _no_ops() -> Any:
    class NoGemms:  # DeepGEMM's two calls, doing nothing
        def masked(self, *args: Any) -> None:
            pass

        def contiguous(self, *args: Any) -> None:
            pass

    return NoGemms()


def build(shape: str, path: str, table: str) -> tuple[Any, Any]:
    """(dispatcher runner, experts runner) of the `cuda` pipeline for a bench shape on the CPU."""
    from moehal.bench import SHAPES
    from moehal.config import MoEConfig
    from moehal.formats import ActivationFormat, Layout, SmallBatchFormat
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.quant import QuantScheme
    from moehal.weights import quantize_weights
    from moehal_cuda.deepgemm_experts import MASKED_ROW_ALIGNMENT, DeepGemmExpertsRunner
    from moehal_cuda.dispatch import CudaPermuteDispatcher
    from moehal_cuda.gemm_choice import GemmChooser

    cfg = MoEConfig(**SHAPES[shape], max_tokens=256)
    quant = QuantScheme.parse("bf16")
    e = cfg.num_local_experts
    w13 = torch.zeros(e, cfg.w13_rows, cfg.hidden_size, dtype=cfg.dtype)
    w2 = torch.zeros(e, cfg.hidden_size, cfg.intermediate_size, dtype=cfg.dtype)
    req = BuildRequest(cfg, quant, detect("cpu"))
    masked = ActivationFormat(Layout.MASKED, cfg.dtype, row_alignment=MASKED_ROW_ALIGNMENT)
    std = ActivationFormat(Layout.STANDARD, cfg.dtype)
    small = SmallBatchFormat(std, 256, "token-major") if path == "token" else None
    disp = CudaPermuteDispatcher().build(req, std if path == "token" else masked)
    experts = DeepGemmExpertsRunner(req, masked, _no_ops(), GemmChooser(table), small)
    experts.load(quantize_weights(cfg, quant, w13, w2))
    return disp, experts


def forward(disp: Any, experts: Any, x: torch.Tensor, topk: Any, stage: dict[str, list[float]] | None = None) -> None:
    """One eager forward's three stages; with `stage`, each stage's host us appended there."""
    t0 = time.perf_counter()
    inp, handle = disp.dispatch(x, topk)
    t1 = time.perf_counter()
    y = experts.apply(inp)
    t2 = time.perf_counter()
    disp.combine(y, handle)
    if stage is not None:
        t3 = time.perf_counter()
        for name, us in zip(stage, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            stage[name].append(us * 1e6)


def median_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_round)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--path", choices=("masked", "token"), default="masked")
    p.add_argument("--table", default="NVIDIA H100 80GB HBM3", help="the shipped tuned table to choose GEMMs from")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None  # every Triton kernel: a no-op
    from moehal.routing import TopK

    disp, experts = build(a.shape, a.path, a.table)
    cfg = experts.config
    for t in map(int, a.tokens.split(",")):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, cfg.hidden_size, generator=g).to(cfg.dtype)
        ids = torch.rand(t, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].int()
        topk = TopK(ids, torch.rand(t, cfg.top_k, generator=g))
        stage: dict[str, list[float]] = {"dispatch": [], "apply": [], "combine": []}
        fwd = functools.partial(forward, disp, experts, x, topk)
        for _ in range(50):
            fwd()
        us = median_us(fwd, a.calls)
        for _ in range(a.calls):
            fwd(stage)
        parts = ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in stage.items())
        print(f"{a.shape} T={t} {a.path}: {us:.1f} us per forward ({parts})")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                fwd()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())


if __name__ == "__main__":
    main()
