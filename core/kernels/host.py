"""Host-side helpers of the Triton kernel wrappers: the integer arithmetic that sizes grids and
tiles, whether the kernels run under Triton's CPU interpreter, and the mode persistent buffers
are allocated in. No triton import.

Why not `triton.cdiv` / `triton.next_power_of_2`: in recent Triton they are `constexpr_function`s,
and a call from host code goes through their argument unwrapping. An eager decode step made
about 20 such calls; on the device's host (H100, Python 3.12, Triton 3.6) they showed up as the
second-largest entry of the forward's profile (docs/device-runs/2026-11-23-session5).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from moehal.errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on", "y"})  # Triton's words for true (3.9)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for b > 0 (as `triton.cdiv`)."""
    return -(-a // b)


def dense_aligned(t: torch.Tensor, alignment: int = 16) -> torch.Tensor:
    """`t` contiguous and starting at an `alignment`-byte address, copied only when it is not.

    For vendor kernels that take a bare pointer and move rows in 16-byte vectors (DeepEP, AITER,
    FlashInfer's `fp4_quantize`, Ascend's `fused_deep_moe`). `.contiguous()` alone keeps a
    dense view at an odd storage offset (`flat[1:].view(T, H)`), whose rows such a kernel would
    load misaligned: a fault, or wrong data. A copy comes from the allocator, aligned."""
    t = t.contiguous()
    return t if t.data_ptr() % alignment == 0 else t.clone()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for n <= 0 (as `triton.next_power_of_2`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpreting() -> bool:
    """Whether `triton.jit` would make interpreted kernels now: Triton's own knob once Triton is
    imported (TRITON_INTERPRET as Triton reads it, or `triton.knobs.runtime.interpret` set in
    code), else the variable read with Triton's words for true."""
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def interpreter_too_old(version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why this Triton's interpreter cannot run moehal's kernels (None: it can). `version`,
    `numpy_version`: the installed triton's and numpy's unless given.

    Triton's interpreter takes a kernel parameter as a constant from its annotation. Before 3.4
    it did not read the string "tl.constexpr" that `from __future__ import annotations` leaves
    in moehal's kernel modules, so every constant arrived as a tensor and the first `tl.arange`
    failed. Compiled kernels are unaffected: the compiler reads the string.

    Before 3.7 the interpreter took a loop bound's index as `int()` of a 1-element array, which
    numpy 2.4 refuses (deprecated since 1.25): every kernel loop with a runtime bound failed
    (`TypeError: only 0-dimensional arrays can be converted to Python scalars`, triton-lang/triton
    #9171; measured with 3.4.0 and 3.6.0; 3.7.0, 3.7.1 and 3.8.0 pass). CUDA torch wheels pin
    such a Triton (torch 2.11: 3.6.0), so the fix that never touches torch is an older numpy."""
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    if version is None:
        try:
            version = metadata.version("triton")
        except metadata.PackageNotFoundError:
            return None  # another distribution's triton (ROCm's): not one of the old interpreters
    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        return None
    if release < (3, 4):
        why = "ignores moehal's kernel constants (fixed in 3.4)"
        return f"Triton {version}'s interpreter {why}: pip install 'triton>=3.4'"
    if release >= (3, 7):
        return None
    if numpy_version is None:
        try:
            numpy_version = metadata.version("numpy")  # (read as triton's is)
        except metadata.PackageNotFoundError:
            return None
    try:
        if Version(numpy_version).release[:2] < (2, 4):
            return None
    except InvalidVersion:
        return None
    return (
        f"Triton {version}'s interpreter fails on loops with a runtime bound under numpy {numpy_version} "
        "(numpy 2.4 refuses int() of a 1-element array; fixed in Triton 3.7): pip install 'numpy<2.4' "
        "(leaves torch and its pinned Triton alone), or pip install 'triton>=3.7' where torch pins no Triton"
    )


# How `triton.jit` decorated moehal's kernel modules, fixed by the first one imported (each
# calls `kernel_modules_interpreted` as it decorates its kernels). Their interpreter-only flags
# (exact rounding, upcasts) are this value: read once, not from the environment at each launch.
# A mode changed after the first import would mix interpreted and compiled kernels, or run
# interpreted kernels without their workarounds (outputs off by 1e10 on the CPU): refused.
_KERNEL_MODE: list[bool] = []


def kernel_modules_interpreted() -> bool:
    """For a kernel module at import: whether its kernels are interpreted. Raises `ConfigError`
    where the mode differs from the one moehal's first kernel module was decorated in."""
    now = interpreting()
    if not _KERNEL_MODE:
        _KERNEL_MODE.append(now)
    elif _KERNEL_MODE[0] != now:
        raise ConfigError(mode_change_reason())
    return now


def mode_change_reason() -> str:
    was = "interpreted" if _KERNEL_MODE and _KERNEL_MODE[0] else "compiled"
    return (
        f"TRITON_INTERPRET changed after moehal's Triton kernels were imported ({was} then): triton.jit "
        "fixes the mode when it decorates a kernel. Set it before the process imports moehal's kernels, "
        "and leave it as it is"
    )


def interpreter_mode_changed() -> bool:
    """Whether Triton's interpret mode now differs from the one the kernels were decorated in."""
    return bool(_KERNEL_MODE) and _KERNEL_MODE[0] != interpreting()


def kernels_interpreted() -> bool:
    """Whether moehal's Triton kernels run (or, not imported yet, will run) in the interpreter,
    on whatever device: an execution mode that reports must say, a GPU's included."""
    return _KERNEL_MODE[0] if _KERNEL_MODE else interpreting()


def persistent_tensors() -> torch.inference_mode:
    """The mode to allocate buffers in that outlive the call (workspaces, scratch, a graph's
    static inputs): normal tensors, even where the call that allocates them runs under
    `torch.inference_mode()`, as engines serve. A tensor made there is an inference tensor,
    and torch refuses in-place updates of it outside that mode: a layer whose first forward ran
    in inference mode raised at its next forward under `torch.no_grad()` (conformance's
    `inference_mode` check). Normal tensors may be updated in place in either mode."""
    return torch.inference_mode(False)


# The process-wide buffers fetched while a moehal graph capture runs (`fetched_buffers`), per
# thread: captures in two threads (one per GPU) each keep their own.
_FETCHED = threading.local()


def note_fetched(buf: object) -> None:
    """Record a process-wide buffer (a workspace, a scratch tensor) that a call just fetched,
    for the graph capture in progress in this thread, if any: its graph writes that memory at
    every replay."""
    stack = getattr(_FETCHED, "stack", None)
    if stack:
        stack[-1].append(buf)


@contextmanager
def fetched_buffers() -> Iterator[list[object]]:
    """The process-wide buffers fetched inside the block, for a captured graph to keep.

    Why: `release_workspaces` forgets them, and a layer that fetches one per call (a
    contiguous prefill, a dispatch of more than the kept token counts) holds no reference to
    it, while the graph it captured writes there at every replay: freed memory, once released,
    unless the graph keeps them."""
    held: list[object] = []
    stack = getattr(_FETCHED, "stack", None)
    if stack is None:
        stack = _FETCHED.stack = []
    stack.append(held)
    try:
        yield held
    finally:
        stack.pop()


class RecentBinds(OrderedDict):  # type: ignore[type-arg]
    """A dict of launches bound per batch size (a row bound, a token count), keeping the
    `limit` most recently used. A server's stream of prefill sizes brings a new size at almost
    every call: kept for good, one layer's entries grew with every size seen (a review's
    count, session 54: 1786 entries after 2000 calls, about 2 KB of host memory each, per layer
    and per dict); decode sizes recur and stay."""

    def __init__(self, limit: int = 256) -> None:
        super().__init__()
        self.limit = limit

    def get(self, key: object, default: object = None) -> object:  # type: ignore[override]
        try:  # (no test first: another thread may evict the key between a test and a move)
            self.move_to_end(key)
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)
