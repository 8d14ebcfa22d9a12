"""Poisoning fresh allocations, so a kernel that reads memory it never wrote fails every time.

`torch.empty` hands back whatever the allocator last freed: often zeros, or values that happen
to be harmless, so a kernel that reads rows it never wrote (a sentinel left unwritten, padding
rows a combine weighs by zero, a counter never cleared) passes most runs. The mutation audit of
session 45 found one such bug that conformance caught only by chance. Inside `poisoned()` every
tensor made by torch's empty-family ops is filled before the caller sees it (conformance runs
every case so, the expert-parallel ranks included; see docs/conformance.md):

- floating types with NaN (all bits set for the 1-byte formats: NaN in e4m3fn, e5m2 and e8m0,
  the largest magnitude in the packed FP4 pair), so any use of an unwritten value reaches the
  output, and `compare` fails NaN outright;
- integers with 1 and bools with True: an index in range, so a stray read changes the result
  rather than faulting the device, and a counter that was never cleared counts one too many.

Only allocations made through the dispatcher from Python are seen. Kernels' own allocations
inside C++ or vendor libraries are not, nor those inside a `torch.library` custom op (the mode is
off while an op it intercepts runs; conformance calls layers eagerly, so this does not arise).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
ALLOCATORS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
INT_POISON = 1
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)  # torch >= 2.8; moehal supports torch >= 2.6


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with its dtype's poison (see the module docstring); returns `t`."""
    if t.numel() == 0 or t.device.type == "meta" or t.is_quantized or t.is_complex():
        return t
    if t.dtype == torch.bool:
        t.fill_(True)
    elif (t.element_size() == 1 and t.dtype.is_floating_point) or (_FP4 is not None and t.dtype == _FP4):
        t.view(torch.uint8).fill_(0xFF)  # 1-byte floats: fill_ cannot write NaN to all of them
    elif t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(INT_POISON)
    return t


class PoisonMode(TorchDispatchMode):
    """Fills every tensor an empty-family op returns (`ALLOCATORS`) with `poison_`; counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in ALLOCATORS and isinstance(out, torch.Tensor):
            poison_(out)
            self.poisoned += 1
        return out


@contextmanager
def poisoned(enabled: bool = True) -> Iterator[PoisonMode | None]:
    """Poison fresh allocations inside the block (a no-op where not `enabled`)."""
    if not enabled:
        yield None
        return
    mode = PoisonMode()
    with mode:
        yield mode
