# ruff: noqa: ANN001, ANN201  (Triton JIT helpers: arguments are untyped by design)
"""Programmatic dependent launch (PDL) for the decode chain's Triton kernels (scatter, GEMM1 +
activation, GEMM2, combine).

Why: a decode step is a chain of short kernels. A replayed Qwen3-30B-A3B step on an H100
measured 0.3-0.4 us of idle GPU between our kernels, and SGLang's chain overlaps each kernel's
launch with the previous one's tail (its kernels start before their predecessors end:
docs/device-runs/2026-11-23-session5, `tools/graph_trace.py`). On SM90 and newer, a kernel
launched with PDL may be scheduled while the kernel before it is still running, once every
program of that kernel has called `launch_dependents` (or exited).

Why it is safe: every PDL-aware kernel here waits (`griddepcontrol.wait`: the previous kernel
has completed and its writes are visible) before its first load or store. Where it allows the
next kernel to be scheduled changes only timing, never a result.

Modes (`set_mode`; `MODES`): `off`; `early`: each kernel lets the next one be scheduled as soon
as it has waited; `late`: after its main loop, before its stores. Off under the interpreter, on
CPUs, before SM90, and with a Triton without the feature.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

MODES = ("off", "early", "late")
_mode = "off"


def set_mode(mode: str) -> None:
    """Choose the PDL mode for later launches in this process (for measurements)."""
    if mode not in MODES:
        raise ValueError(f"PDL mode must be one of {MODES}, got {mode!r}")
    global _mode
    _mode = mode


def mode() -> str:
    return _mode


@functools.cache
def _supported(device_index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" not in CUDAOptions.__dataclass_fields__ or not hasattr(tl.extra.cuda, "gdc_wait"):
            return False
        return torch.cuda.get_device_capability(device_index)[0] >= 9 and torch.version.hip is None
    except Exception:  # no NVIDIA backend in this Triton build, no CUDA runtime, ...
        return False


def pdl_args(device: torch.device) -> dict[str, Any]:
    """Launch keywords of a PDL-aware kernel: its `USE_PDL` / `PDL_EARLY` constexprs and, when
    on, Triton's `launch_pdl` option."""
    from moehal.kernels.host import INTERPRETED

    if _mode == "off" or device.type != "cuda" or INTERPRETED:
        return {"USE_PDL": False, "PDL_EARLY": False}
    if not _supported(device.index if device.index is not None else torch.cuda.current_device()):
        return {"USE_PDL": False, "PDL_EARLY": False}
    return {"USE_PDL": True, "PDL_EARLY": _mode == "early", "launch_pdl": True}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    """First statement of a PDL-aware kernel: wait until the previous kernel has completed and
    its writes are visible (and, in `early` mode, let the next kernel be scheduled)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    """`late` mode: let the next kernel be scheduled (call after the main loop, before stores)."""
    if USE_PDL:
        if not PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
