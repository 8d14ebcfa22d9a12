# ruff: noqa: ANN001, ANN201  (Triton JIT helpers: arguments are untyped by design)
"""Programmatic dependent launch (PDL) for the Triton kernels of a forward.

A decode step is a chain of small kernels, and each boundary costs the GPU a launch latency
(about a microsecond or two on an H100) while the SMs idle. On SM90 and newer, a kernel launched
with PDL may be scheduled while the kernel before it is still finishing; it then waits
(`griddepcontrol.wait`) until that kernel has completed and its writes are visible, before
touching memory. Only the launch latency is overlapped: every kernel here waits before its
first load or store, so no result can change, whatever ran before (PDL or not, Triton or
DeepGEMM or torch: a kernel launched without PDL waits for its predecessor as usual).

Off under the Triton interpreter, on CPUs, before SM90, and with a Triton that lacks the
feature. `set_enabled(False)` turns it off for the process (A/B measurements).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

_ENABLED = True


def set_enabled(enabled: bool) -> None:
    """Allow (default) or forbid PDL launches in this process; takes effect at the next launch."""
    global _ENABLED
    _ENABLED = bool(enabled)


@functools.cache
def _supported(device_index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" not in CUDAOptions.__dataclass_fields__ or not hasattr(tl.extra.cuda, "gdc_wait"):
            return False
        return torch.cuda.get_device_capability(device_index)[0] >= 9 and torch.version.hip is None
    except Exception:  # no NVIDIA backend in this Triton build, no CUDA runtime, ...
        return False


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    from moehal.kernels.triton_experts import interpreting

    if not _ENABLED or device.type != "cuda" or interpreting():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a kernel launch: the kernel's `USE_PDL` constexpr and, when on,
    Triton's `launch_pdl` option."""
    on = enabled(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: wait until the previous kernel in the stream has
    completed (its writes visible), then let the next kernel be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
