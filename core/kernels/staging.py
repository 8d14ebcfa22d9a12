# ruff: noqa: ANN001, ANN202  (Triton JIT kernels: arguments are untyped by design)
"""Copy a replayed graph's inputs into its static buffers with one kernel launch.

Why: an eager forward that replays a CUDA graph (`moehal.graphs`) first copies the caller's
tensors into the graph's static inputs. On an H100 host (docs/device-runs/2026-11-23-session5)
that copy cost more host time than anything else in the call: 28.5 us for three tensors through
`torch._foreach_copy_` (11.3 us per `Tensor.copy_`), against 5.6 us for the replay itself. One
Triton kernel copies all of them; after its first launch it is launched through the compiled
kernel's own launcher, which skips the JIT entry's argument binding and cache lookup (11 us
against 31 us for a 16-argument kernel on the same host).

Why that is safe: a `Stager` belongs to one captured graph, so its destinations and sizes never
change; only the sources do. The compiled kernel was specialized for 16-byte aligned sources,
so every call checks that (and contiguity) and otherwise copies with torch. Launch hooks
(profilers such as proton) and Triton releases without the launcher this relies on take
Triton's ordinary launch path.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from moehal.kernels.host import cdiv

BLOCK = 1024  # int32 words per program
MAX_INPUTS = 4


@triton.jit
def _copy_words(s0, d0, n0, s1, d1, n1, s2, d2, n2, s3, d3, n3, BLOCK: tl.constexpr):
    # grid (word blocks, inputs): program (b, j) copies words [b*BLOCK, (b+1)*BLOCK) of input j
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(1)
    if j == 0:
        tl.store(d0 + offs, tl.load(s0 + offs, mask=offs < n0), mask=offs < n0)
    elif j == 1:
        tl.store(d1 + offs, tl.load(s1 + offs, mask=offs < n1), mask=offs < n1)
    elif j == 2:
        tl.store(d2 + offs, tl.load(s2 + offs, mask=offs < n2), mask=offs < n2)
    else:
        tl.store(d3 + offs, tl.load(s3 + offs, mask=offs < n3), mask=offs < n3)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s bytes as int32 words, or None where it cannot be viewed so (or is misaligned)."""
    if not t.is_contiguous() or t.nbytes % 4 or t.data_ptr() % 16:
        return None
    return t.view(-1).view(torch.uint8).view(torch.int32) if t.numel() else None


class Stager:
    """Copies `len(dests) <= 4` CUDA tensors into `dests` (same shapes and dtypes) with one
    kernel: `stager(sources)`. Stream-ordered on the current stream, like `Tensor.copy_`."""

    def __init__(self, dests: tuple[torch.Tensor, ...]) -> None:
        self.dests = dests
        words = [_words(d) for d in dests]
        self._ok = 0 < len(dests) <= MAX_INPUTS and all(w is not None for w in words)
        self._dst = [w for w in words if w is not None]
        self._n = [w.numel() for w in self._dst]
        self._grid = (cdiv(max(self._n, default=1), BLOCK), len(dests))
        self._compiled: Any = None
        self._device = dests[0].device.index if dests and dests[0].device.type == "cuda" else -1
        self.direct_launches = 0  # calls that went through the compiled kernel's launcher

    def _args(self, src: list[torch.Tensor]) -> list[Any]:
        args: list[Any] = []
        for j in range(MAX_INPUTS):
            if j < len(src):
                args += [src[j], self._dst[j], self._n[j]]
            else:  # unused slot: never read (its program id is out of the grid)
                args += [self._dst[0], self._dst[0], 0]
        return args

    def __call__(self, sources: tuple[torch.Tensor, ...]) -> None:
        src = [_words(s) for s in sources] if self._ok else []
        if not self._ok or any(w is None for w in src):
            torch._foreach_copy_(self.dests, sources)
            return
        args = self._args(src)  # type: ignore[arg-type]
        ck = self._compiled
        if ck is not None and _no_launch_hooks() and torch.cuda.current_device() == self._device:
            stream = _driver().get_current_stream(self._device)
            ck.run(*self._grid, 1, stream, ck.function, ck.packed_metadata, None, None, None, *args, BLOCK)
            self.direct_launches += 1
            return
        dev = self.dests[0].device
        if dev.type == "cuda":
            with torch.cuda.device(dev):
                ck = _copy_words[self._grid](*args, BLOCK=BLOCK)
        else:  # the interpreter (tests on CPU): the kernel's logic, never the direct launch
            ck = _copy_words[self._grid](*args, BLOCK=BLOCK)
        if dev.type == "cuda" and self._compiled is None and _has_launcher(ck):
            self._compiled = ck


def _driver() -> Any:
    from triton.runtime import driver

    return driver.active


def _has_launcher(ck: Any) -> bool:
    """Whether `ck` is a compiled kernel with the launcher `Stager` calls (Triton 3.x)."""
    return all(hasattr(ck, a) for a in ("run", "function", "packed_metadata"))


def _no_launch_hooks() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # a release without knobs: keep to the ordinary launch path
        return False
    return knobs.runtime.launch_enter_hook is None and knobs.runtime.launch_exit_hook is None
