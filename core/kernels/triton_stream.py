# ruff: noqa: ANN001, ANN202  (Triton JIT kernels: arguments are untyped by design)
"""A read-only streaming kernel in Triton: the benchmark's bandwidth ceiling for weight reads.

Why: a MoE layer at decode sizes reads its expert weights once and writes almost nothing, so
its roofline's bandwidth term should be what the device reaches reading. The issue defines it
by a copy (reads and writes), and `torch.sum` over 1 GiB measured the same rate on an H200
(4.14 TB/s) while the layer's DeepGEMM rows streamed weights at up to 4.38 TB/s
(docs/device-runs/2026-11-27-session42): neither is a ceiling for what the layer reads. This
kernel keeps many wide loads in flight on every SM and does nothing else with the data.

Each program sums its share of `x` (grid-stride over blocks of `block` elements, so that at any
moment the programs read one contiguous window of memory) and stores one float32 partial sum;
the sum of the partials is the sum of `x`, which is how the tests check that every element was
read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moehal.kernels.host import cdiv, kernel_modules_interpreted

kernel_modules_interpreted()  # the mode triton.jit decorates this module's kernels in: checked (host.py)


@triton.jit
def _stream_read(x_ptr, partial_ptr, n, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):  # a constexpr bound: Triton 3.6's interpreter fails on runtime-bound loops
        idx = (i * programs + pid).to(tl.int64) * BLOCK + offs
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def stream_read(x: torch.Tensor, partials: torch.Tensor, block: int = 4096, num_warps: int = 8) -> torch.Tensor:
    """Read every element of the contiguous tensor `x` once; `partials` (float32, one per
    program: its length is the grid) receives per-program sums, whose total is `x.sum()`.

    Args:
        x: any floating dtype, contiguous, on the device the kernel runs on.
        partials: float32 `[programs]` on `x`'s device; a few programs per SM keep enough loads
            in flight (`moehal.bench` tries several grids and block sizes).
        block: elements each program loads per step (a power of two).
        num_warps: warps per program.

    Returns `partials`.
    """
    if not x.is_contiguous():
        raise ValueError("stream_read reads a contiguous tensor")
    if partials.dtype != torch.float32 or partials.dim() != 1 or partials.device != x.device:
        raise ValueError("partials must be a 1-D float32 tensor on x's device")
    programs = partials.numel()
    iters = cdiv(x.numel(), programs * block)
    _stream_read[(programs,)](x, partials, x.numel(), ITERS=iters, BLOCK=block, num_warps=num_warps)
    return partials
