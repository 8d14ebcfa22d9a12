"""Eager forwards replayed from CUDA graphs: one capture per token count, for engines that do
not capture graphs themselves.

Why: an eager forward pays Python and launch overhead for every kernel it queues (hundreds of
microseconds on the CUDA backends, far above the tens that a decode step can afford). A CUDA
graph queues the whole forward with one launch. `MoELayer(..., cuda_graph_tokens=N)` (or
setting `layer.cuda_graph_tokens`) captures, on the first eager call with T <= N tokens, the
forward for that T and replays it on every later call with T tokens.

What a replay costs and assumes:
- Inputs at the addresses of an earlier call of this token count (persistent buffers, or a
  steady loop whose allocations repeat) replay a graph captured on those very tensors: no
  copy. Other inputs are copied into a graph's own static inputs (one `torch._foreach_copy_`
  of their bytes: one kernel).
  The returned tensor is the caller's to keep, as in an ordinary eager call: each call
  allocates its output, and where that address recurs too (a caller that drops each result
  before the next call, or alternates between two buffers, as a residual add does) a direct
  graph captured on it writes the result there; otherwise the graph's output is copied into it. A caller that
  passes `out=` (an engine's persistent output buffer) gets a direct graph that writes into
  `out` itself. Either way the call costs one replay, and no graph keeps a reference to an
  output: a graph writes an address only when this call's own output sits there.
  `MoELayer.forward` tries that direct graph before its input checks (`replay_direct`): the
  graph's signature pins everything the checks look at.
  Host cost of each part on H100 hosts: docs/device-runs/2026-11-23-session5, -session6 and
  -session10 (the in-place output).
- One capture per distinct token count (plus up to `DIRECT_PER_TOKEN_COUNT` direct ones),
  sharing one memory pool per layer; engines bucket their batch sizes, so the set stays small.
  Larger batches run eagerly: their GPU time dwarfs the launch overhead.
- Only pipelines that declare `graph_capturable` can be replayed (checked when enabled).
- Inside someone else's capture, or while torch.compile traces, the layer runs as usual.
"""

from __future__ import annotations

import gc
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from moehal.kernels.host import fetched_buffers, next_power_of_2, persistent_tensors

_log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static inputs; () for a graph that reads the caller's tensors
    output: torch.Tensor | None  # None for a graph that writes the caller's `out`
    input_bytes: tuple[torch.Tensor, ...] = ()  # copying graphs: the static inputs as uint8 views (`copy_in`)
    # the process-wide buffers the capture fetched, which its replays write (`fetched_buffers`)
    held: tuple[object, ...] = ()

    def copy_in(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Copy the caller's tensors into the static inputs. One `torch._foreach_copy_` of
        tensors of several dtypes (hidden states, ids, weights) takes torch's per-tensor path: a
        kernel launch each. As bytes they are one list of one dtype: one launch for all. Inputs
        that are not contiguous take the typed copy, which handles any strides."""
        # (a `[T, 1]` tensor with strides (1, T) is contiguous to torch, yet only a last stride
        # of 1 lets it be viewed as bytes: top-1 ids and weights transposed from `topk` are so)
        if BYTE_COPY_INPUTS and all(t.is_contiguous() and t.stride(-1) == 1 for t in inputs):
            torch._foreach_copy_(self.input_bytes, [t.view(torch.uint8) for t in inputs])
        else:
            torch._foreach_copy_(self.inputs, inputs)


# On by default. False: copying graphs copy their inputs as typed tensors, a launch per dtype
# (a diagnostic switch for host-time A/Bs, like `MEMO_ENABLED`).
BYTE_COPY_INPUTS = True


# Graphs per token count that read the caller's own input tensors (see `GraphCache`).
DIRECT_PER_TOKEN_COUNT = 4


_WARNED: set[str] = set()  # launch memo failures warned about, by reason
_WARNED_LOCK = threading.Lock()


def _weak_callable(fn: Callable[..., object]) -> Callable[[], Callable[..., object]]:
    """A getter of `fn` that holds a bound method's object weakly. The caches here belong to the
    object whose method they run (a layer's forward, DeepGEMM's ops): a strong bound method
    would close a reference cycle, and the layer, its weights and its graphs' memory pools
    would outlive `del layer` until the next full garbage collection."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)  # type: ignore[return-value]
    return lambda: fn


class GraphCache:
    """Per-token-count CUDA graphs of one forward function `fn(*tensors) -> Tensor`, or
    `fn(*tensors, out=None) -> Tensor` for one that can write its result into a given tensor.

    Two kinds of graph, both replayed on the current stream:

    - **copying** (one per token count and input dtypes): reads static input buffers of its
      own, into which each call copies the caller's tensors first.
    - **direct** (at most `DIRECT_PER_TOKEN_COUNT` per token count, with and without `out=`): captured on the caller's
      own tensors, for a caller that passes tensors at the same addresses call after call (an
      engine's persistent input buffers, or a steady decode loop whose allocations repeat).
      It is captured the second time in a row one token count arrives at the same addresses,
      and replayed only when every input is at exactly the address, with the shape, dtype and
      strides, it was captured on: it then reads what the caller passed now, as an eager call
      would, with no copy. It keeps no reference to the caller's tensors and never writes to
      them (the forward only reads its inputs), so a freed and reused address is only ever
      read when the caller passes a tensor there. The output's address is one more captured
      address, where it repeats: the caller's `out=`, or the output this call allocated (the
      graph writes the result there, and nothing is copied); where it does not, the graph's
      own output is copied into this call's.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], device: torch.device) -> None:
        self._fn_ref = _weak_callable(fn)
        # `fn(*inputs, out=buf)` writes its result into `buf` (`MoELayer._forward_topk`): graphs
        # that write an output then capture that, not the forward followed by a copy
        self._fn_takes_out = "out" in inspect.signature(fn).parameters
        self._device = device
        self._on_cuda = device.type == "cuda"
        self._graphs: dict[tuple, _Captured] = {}  # key -> copying graph
        self._direct: dict[tuple, _Captured] = {}  # where -> direct graph
        # the inputs' part of every direct graph's `where`: a call on other tensors (new inputs,
        # or a batch above the graph limit) is told apart before an output is allocated for it
        self._direct_inputs: set[tuple] = set()
        self._direct_per_key: dict[tuple, int] = {}
        self._last: dict[tuple, tuple] = {}  # key -> where the previous call's inputs and output were
        self._last_output: dict[tuple, tuple] = {}  # inputs' signature -> where its last 2 outputs were
        self._missed: tuple | None = None  # (signature, out, output) `replay_direct` found no graph for
        self._pool: object | None = None
        # The rows graphs read and write, shared by every token count (`_rows`): (role, dtype,
        # trailing shape) -> a buffer of a power-of-two capacity, replaced by a larger one when a larger
        # count comes (graphs captured on the old one keep it). A graph per count with its own
        # inputs and output held sum(T) rows: 3.5 GiB per layer of DeepSeek-V3's hidden size at
        # every count up to 512 (a review's simulation, session 54); this holds under 2x the largest.
        self._rows_kept: dict[tuple, torch.Tensor] = {}

    @property
    def captured_token_counts(self) -> list[int]:
        """Token counts that have a captured graph (ascending)."""
        return sorted({key[0] for key in self._graphs} | {where[2][0] for where in self._direct})

    @property
    def direct_graphs(self) -> int:
        """How many graphs read the caller's tensors in place (no input copy)."""
        return len(self._direct)

    @property
    def output_writing_graphs(self) -> int:
        """How many direct graphs write the result into the call's output itself (`out=`, or a
        new output whose address recurs) instead of copying it out."""
        return sum(cap.output is None for cap in self._direct.values())

    def clear(self) -> None:
        self._graphs.clear()
        self._direct.clear()
        self._direct_inputs.clear()
        self._direct_per_key.clear()
        self._last.clear()
        self._last_output.clear()
        self._missed = None
        self._pool = None
        self._rows_kept.clear()

    def _rows(self, role: int | str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The first `rows` rows of this cache's buffer for `role` (a copying graph's static
        input by its position, or "out": the output a graph writes when the caller gives none,
        copied out at once after each replay, so every graph may share it), shaped as `like`
        past the first dim."""
        kind = (role, like.dtype, tuple(like.shape[1:]))
        # normal tensors and views, whatever the caller's mode: later calls write them in place,
        # maybe outside `torch.inference_mode()` (a view made inside could not be written there)
        with persistent_tensors():
            full = self._rows_kept.get(kind)
            if full is None or full.shape[0] < rows:
                full = torch.empty((next_power_of_2(max(rows, 1)), *kind[2]), dtype=like.dtype, device=like.device)
                self._rows_kept[kind] = full
            return full[:rows]

    def replay_direct(self, inputs: tuple, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay the direct graph captured on exactly these tensors (and `out`), or return None.

        The steady state of an engine's decode loop, so the caller (`MoELayer.forward`) tries it
        before its input checks: a direct graph is only captured after those checks passed, and
        its signature pins every address, dtype, shape and stride they looked at. (Addresses
        also pin the device: CUDA's unified addressing gives host and each GPU disjoint
        ranges.) Anything else, a non-tensor included, returns None and takes the checked path.
        """
        if not self._direct:
            return None
        try:
            sig = self.where(inputs, out)  # with `out=`, the inputs' and the output's at once
        except (AttributeError, TypeError):  # None or a non-tensor among the inputs
            return None
        if self._on_cuda and torch.cuda.is_current_stream_capturing():
            return None  # inside someone else's capture the forward runs as usual
        if out is None:
            return self._replay_known(inputs, sig, None)
        cap = self._direct.get(sig)  # `out=` (an engine's own buffer): one lookup
        if cap is not None:
            cap.graph.replay()
            return out
        return self._replay_known(inputs, sig[: 4 * len(inputs)], out)

    def __call__(self, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        sig = self.where(inputs)
        target = self._take_missed(sig, out)
        if target is None:  # called directly, not right after `replay_direct` missed
            y = self._replay_known(inputs, sig, out)
            if y is not None:
                return y
            target = self._take_missed(sig, out)
        fresh = out is None
        if target is None:
            target = out if out is not None else self._fresh_output(inputs)
        full = sig + self._sig(target)
        base = self.key(inputs)
        key = (*base, "fresh" if fresh else "out")  # the last call's addresses, per kind of call
        last_sig, last_full = self._last.get(key, ((), ()))
        self._last[key] = (sig, full)
        if self._direct_per_key.get(key, 0) < DIRECT_PER_TOKEN_COUNT:
            if last_full == full:  # inputs and output where they were: a graph that writes the output
                self._capture_direct(key, full, inputs, target).graph.replay()
                return target
            if fresh and last_sig == sig:  # inputs in place, each output kept by the caller
                cap = self._capture_direct(key, sig, inputs, None)
                cap.graph.replay()
                return target.copy_(cap.output)
        cap = self._graphs.get(base)  # copying graphs serve every kind of call
        if cap is None:
            cap = self._graphs[base] = self._capture(inputs, copy_inputs=True)
        cap.copy_in(inputs)
        cap.graph.replay()
        return target.copy_(cap.output)

    def _replay_known(self, inputs: tuple, sig: tuple, out: torch.Tensor | None) -> torch.Tensor | None:
        """Replay a direct graph for these inputs, if one was captured: the one that writes
        `out`, or without `out`, the one that writes this call's new output where the allocator
        put it, else the one that reads the inputs in place (its output then copied out).
        On a miss, remembers the signature and output for the `__call__` that follows. Inputs
        that no direct graph reads return None at once: nothing is allocated for a call that
        takes the copying graph or runs eagerly (a prefill batch above the graph limit)."""
        if sig not in self._direct_inputs:
            return None
        target = out if out is not None else self._fresh_output(inputs)
        target_sig = self._sig(target)
        cap = self._direct.get(sig + target_sig)
        if cap is not None:
            cap.graph.replay()
            return target
        cap = self._direct.get(sig) if out is None else None
        if cap is None:
            self._missed = (sig, out, target)
            return None
        recent = self._last_output.get(sig, ())
        if target_sig in recent:  # the output's address recurs as well (alternating between two
            # buffers included, as a residual add's does): a graph that writes there copies nothing
            key = (*self.key(inputs), "fresh")
            if self._direct_per_key.get(key, 0) < DIRECT_PER_TOKEN_COUNT:
                self._capture_direct(key, sig + target_sig, inputs, target).graph.replay()
                return target
        self._last_output[sig] = (target_sig, *recent[:1])
        cap.graph.replay()
        return target.copy_(cap.output)

    def _take_missed(self, sig: tuple, out: torch.Tensor | None) -> torch.Tensor | None:
        """The output `replay_direct` allocated (or was given) for this very call when it found
        no graph, so the checked path neither looks up nor allocates twice; None otherwise."""
        missed, self._missed = self._missed, None
        if missed is None or missed[1] is not out or missed[0] != sig:
            return None
        return missed[2]

    def _capture_direct(
        self, key: tuple, where: tuple, inputs: tuple[torch.Tensor, ...], out: torch.Tensor | None
    ) -> _Captured:
        cap = self._direct[where] = self._capture(inputs, copy_inputs=False, out=out)
        self._direct_inputs.add(where[: 4 * len(inputs)])
        self._direct_per_key[key] = self._direct_per_key.get(key, 0) + 1
        return cap

    @staticmethod
    def _fresh_output(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """A new output for one call: the forward's output has its first input's shape and
        dtype (`_capture` checks it)."""
        x = inputs[0]
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def key(inputs: tuple[torch.Tensor, ...]) -> tuple:
        """One copying graph per token count and input dtypes: the caller (`MoELayer.forward`)
        checked the shapes against the layer's config, so these decide them (a cheaper key than
        every shape, on the hot path)."""
        return (inputs[0].shape[0], *[t.dtype for t in inputs])

    @staticmethod
    def where(inputs: tuple[torch.Tensor, ...], out: torch.Tensor | None = None) -> tuple:
        """What a direct graph was captured on: each input's address, dtype, shape and strides
        (and the output buffer's), in one flat tuple; its first shape is the token count's."""
        if len(inputs) == 3:  # the top-k forward, unrolled: this runs at every replay
            x, a, b = inputs
            sig = (x.data_ptr(), x.dtype, x.shape, x.stride(), a.data_ptr(), a.dtype, a.shape, a.stride(),
                   b.data_ptr(), b.dtype, b.shape, b.stride())  # fmt: skip
        else:
            sig = tuple(v for t in inputs for v in (t.data_ptr(), t.dtype, t.shape, t.stride()))
        return sig if out is None else (*sig, out.data_ptr(), out.dtype, out.shape, out.stride())

    @staticmethod
    def _sig(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), t.dtype, t.shape, t.stride())

    def _capture(
        self, inputs: tuple[torch.Tensor, ...], copy_inputs: bool, out: torch.Tensor | None = None
    ) -> _Captured:
        # Static inputs: contiguous whatever the first caller's strides (they are copied into as
        # bytes), and normal tensors whatever the caller's mode (`persistent_tensors`): later
        # calls copy into them in place, maybe outside `torch.inference_mode()`. The forward
        # itself is captured in the caller's mode, which an inference-tensor `out` needs.
        static = inputs
        rows = inputs[0].shape[0]
        if copy_inputs:  # prefixes of buffers shared by every token count, holding this call's values
            static = tuple(self._rows(i, t, rows).copy_(t) for i, t in enumerate(inputs))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Without the caller's `out`, the graph writes the shared output rows (copied out after
        # each replay); with it, it writes there.
        dest = out if out is not None else self._rows("out", inputs[0], rows)
        forward = self._fn_ref()
        if self._fn_takes_out:  # the forward writes `dest` itself: no copy in the graph
            fn = lambda: forward(*static, out=dest)  # noqa: E731
        else:
            fn = lambda: dest.copy_(forward(*static))  # noqa: E731
        # An in-place call (`out` in an input's storage, as `layer(h, ..., out=h)`): the warm-up
        # run that `capture` makes writes the result over the input, and the replay that follows
        # would compute from that result. The input's bytes are kept across the capture.
        kept = None
        if out is not None and not copy_inputs and any(_same_storage(out, t) for t in static):
            kept = out.clone()
        try:
            with fetched_buffers() as held:  # kept by the graph: `release_workspaces` may forget them
                graph, output = capture(fn, self._device, pool=self._pool)
        finally:  # also when the capture fails after the warm-up wrote `out`: a caller that
            if kept is not None:  # catches the error and runs eagerly must find its input
                out.copy_(kept)
        x = inputs[0]
        if output.shape != x.shape or output.dtype != x.dtype:  # what `_fresh_output` relies on
            raise TypeError(f"graphed forward returned {output.dtype} {tuple(output.shape)}, not its input's")
        # A graph that writes `out` keeps no reference to it: a fresh output, once the caller
        # drops it, must go back to the allocator (its address coming back is what hits).
        if not copy_inputs:
            return _Captured(graph, (), dest if out is None else None, held=tuple(held))
        with persistent_tensors():  # (views made in inference mode could not be written outside it)
            input_bytes = tuple(t.view(torch.uint8) for t in static)
        return _Captured(graph, static, output, input_bytes, tuple(held))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was, after it).

    Why around every capture: a collection that runs inside one frees whatever dead cycles
    hold, and a dead cycle may hold an earlier layer's CUDA graphs. Destroying a graph is a call
    that capture forbids: it fails ("operation not permitted when stream is capturing") and
    invalidates the capture in progress, whose next launch then raises. Torch no longer
    collects when a capture begins (`torch.compiler.config.force_cudagraph_gc`), so collections
    fall wherever allocations trigger them. On an H200 this broke `moehal bench`'s second row
    in 3 of 4 runs on a fresh Triton cache (docs/device-runs/2026-11-24-session24).

    Blocks in several threads (a capture per GPU) count: the collector stays off until the
    last one ends, and goes back to what it was before the first (each block restoring its own
    view let one thread's end turn it on during another's capture)."""
    global _GC_PAUSES, _GC_WAS_ENABLED
    with _GC_LOCK:
        if _GC_PAUSES == 0:
            _GC_WAS_ENABLED = gc.isenabled()
            gc.disable()
        _GC_PAUSES += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES -= 1
            if _GC_PAUSES == 0 and _GC_WAS_ENABLED:
                gc.enable()


def gc_pauses() -> int:
    """How many `gc_paused` blocks are open now, in every thread: a caller that would collect
    explicitly (`gc.collect()` ignores `gc.disable()`) waits while this is above 0."""
    return _GC_PAUSES


_GC_LOCK = threading.Lock()
_GC_PAUSES = 0
_GC_WAS_ENABLED = True


def capture(
    fn: Callable[[], torch.Tensor], device: torch.device | None = None, warmup: int = 1, pool: object | None = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `fn()` into a CUDA graph: `warmup` calls first on a side stream (JIT compiles,
    workspace allocation), as torch's docs ask; no garbage collection during the capture
    (`gc_paused`). Returns the graph and the captured output."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
    finally:  # a warm-up that raises may have queued kernels: the caller's stream still waits
        torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, device, pool=pool):
        output = fn()
    return graph, output


@contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, device: torch.device | None = None, pool: object | None = None
) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=pool)` with the collector paused (`gc_paused`), leaving the
    caller's stream current however the capture ends.

    Why: torch's context makes the caller's stream current again only after `capture_end`
    succeeds. A capture that was invalidated (a forbidden call inside it) raises there and
    leaves torch's capture stream current, so the caller's later work runs on that stream,
    unordered with code that uses the default one (session 36: one test's failed capture made
    a later test read a buffer before its write, docs/device-runs/2026-11-26-session36)."""
    caller = torch.cuda.current_stream(device)
    try:
        # thread_local: torch's default ("global") makes CUDA calls that capture forbids fail in
        # every thread of the process, so one thread per GPU could not allocate while another captured
        with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if torch.cuda.current_stream(device) != caller:
            torch.cuda.set_stream(caller)


def should_replay(limit: int, hidden: torch.Tensor) -> bool:
    """Whether this eager call goes through the graph cache."""
    return (
        limit > 0 and hidden.is_cuda and 0 < hidden.shape[0] <= limit and not torch.cuda.is_current_stream_capturing()
    )


# On by default. One DeepGEMM call replayed from its graph takes 4-12 us of host time against
# 27-48 us called (H100 and H200 hosts). Eager forwards that call DeepGEMM took 31-64 us
# (10-12%) less host time with replays on an H100 host (two calls per forward) and 20 us (8.5%)
# on an H200 host (one call), in an interleaved A/B whose rows without DeepGEMM calls moved by
# 2-7 us (session 16: docs/device-runs/2026-11-23-session16). Session 15 measured them slower:
# its capture rule never fired in a layer, whose GEMM1 and GEMM2 take turns, so it paid the
# signatures and no replay. False: every `LaunchMemo` calls its function directly.
MEMO_ENABLED = True


def _signature(value: object) -> object:
    """What a launch reads of one argument: a tensor's address, shape, strides and dtype (the
    device is in the address: unified addressing); a tuple's items; any other value itself."""
    if isinstance(value, torch.Tensor):
        return (value.data_ptr(), value.shape, value.stride(), value.dtype)
    if isinstance(value, tuple):
        return tuple(_signature(v) for v in value)
    return value


class LaunchMemo:
    """One launch sequence `fn(*args) -> None`, replayed from a CUDA graph where it is called
    again on the same tensors and host arguments. For calls whose host path costs far more than
    a replay: DeepGEMM's C++ host code took 19-38 us per grouped GEMM on H100 hosts, a replay
    of its one kernel 4-7 us (docs/device-runs/2026-11-23-session15). Switched by
    `MEMO_ENABLED` (on; see there).

    Exact by construction, as `GraphCache`'s direct graphs: a graph is captured on the tensors
    of a call the second time its signature arrives among the last `capacity` distinct ones (a
    decode loop, where one memo may serve several calls in turn, as a layer's GEMM1 and GEMM2
    share `DeepGemmOps`' masked memo; a one-off shape never pays a capture), and replayed only
    for a call whose every tensor has the address, shape, strides and dtype, and whose every
    other argument the value, that it was captured with (and `context()`, for host state `fn`
    reads besides its arguments). It then reads and writes what a direct call would. `fn` must
    read its tensors' contents only on the GPU (DeepGEMM's masked row counts, for instance),
    never on the host. No graph keeps a reference to a tensor. Inside someone else's capture
    (an engine's, or `GraphCache`'s) `fn` runs as usual. A capture that fails (the library
    synced or allocated in a way capture forbids) switches the memo off, with the reason kept in
    `off_reason`; the call itself still runs directly. At most `capacity` graphs are kept, the
    oldest dropped first.
    """

    def __init__(
        self, fn: Callable[..., None], capacity: int = 16, context: Callable[[], object] | None = None
    ) -> None:
        self._fn_ref = _weak_callable(fn)
        self._context = context  # host state fn reads besides its arguments (DeepGEMM's SM count)
        self._capacity = capacity
        self._graphs: dict[object, torch.cuda.CUDAGraph] = {}  # insertion order: oldest first
        # signatures called once and not captured, oldest first. Session 15's rule, "the same
        # signature twice in a row", never captured in the layer: GEMM1 and GEMM2 take turns.
        self._seen: dict[object, None] = {}
        self._pool: object = None
        self._side: torch.cuda.Stream | None = None
        self.off_reason: str | None = None
        self.replays = 0

    def __call__(self, *args: object) -> None:
        if self.off_reason is not None or not MEMO_ENABLED or torch.cuda.is_current_stream_capturing():
            self._fn_ref()(*args)
            return
        sig = _signature(args) if self._context is None else (_signature(args), self._context())
        graph = self._graphs.get(sig)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        self._fn_ref()(*args)  # this call's result, directly; a capture records without running
        if sig in self._seen:
            del self._seen[sig]
            self._capture(sig, args)
            return
        if len(self._seen) >= self._capacity:
            del self._seen[next(iter(self._seen))]
        self._seen[sig] = None

    def _capture(self, sig: object, args: tuple[object, ...]) -> None:
        if self._side is None:
            self._side = torch.cuda.Stream()
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self._side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self._side), gc_paused():
                graph.capture_begin(self._pool, capture_error_mode="thread_local")
                try:
                    self._fn_ref()(*args)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any capture failure: stop trying, say why
            self.off_reason = f"capture failed: {type(exc).__name__}: {exc}"
            fn = getattr(self._fn_ref(), "__qualname__", "a launch")
            with _WARNED_LOCK:  # a model's layers share the cause: one warning, the rest at DEBUG
                first = self.off_reason not in _WARNED
                _WARNED.add(self.off_reason)
            _log.log(
                logging.WARNING if first else logging.DEBUG,
                "a kernel launch memo of %s stops replaying; its calls run directly (8-12%% more host time "
                "where measured; moehal.graphs.MEMO_ENABLED = False turns every memo off): %s",
                fn,
                self.off_reason,
            )
            return
        torch.cuda.current_stream().wait_stream(self._side)
        if len(self._graphs) >= self._capacity:
            del self._graphs[next(iter(self._graphs))]
        self._graphs[sig] = graph
