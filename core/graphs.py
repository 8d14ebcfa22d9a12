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
  copy. Other inputs are copied into a graph's own static inputs (one `torch._foreach_copy_`).
  The output is cloned either way, so the returned tensor is the caller's to keep, as in an
  ordinary eager call; unless the caller passes `out=` (an engine's persistent output
  buffer): a direct graph then writes into `out` itself, and the call costs one replay.
  `MoELayer.forward` tries that direct graph before its input checks (`replay_direct`): the
  graph's signature pins everything the checks look at.
  Host cost of each part on an H100 host: docs/device-runs/2026-11-23-session5 and -session6.
- One capture per distinct token count (plus up to `DIRECT_PER_TOKEN_COUNT` direct ones),
  sharing one memory pool per layer; engines bucket their batch sizes, so the set stays small.
  Larger batches run eagerly: their GPU time dwarfs the launch overhead.
- Only pipelines that declare `graph_capturable` can be replayed (checked when enabled).
- Inside someone else's capture, or while torch.compile traces, the layer runs as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static inputs; () for a graph that reads the caller's tensors
    output: torch.Tensor


# Graphs per token count that read the caller's own input tensors (see `GraphCache`).
DIRECT_PER_TOKEN_COUNT = 4


class GraphCache:
    """Per-token-count CUDA graphs of one forward function `fn(*tensors) -> Tensor`.

    Two kinds of graph, both replayed on the current stream:

    - **copying** (one per token count and input dtypes): reads static input buffers of its
      own, into which each call copies the caller's tensors first.
    - **direct** (at most `DIRECT_PER_TOKEN_COUNT` per token count): captured on the caller's
      own tensors, for a caller that passes tensors at the same addresses call after call (an
      engine's persistent input buffers, or a steady decode loop whose allocations repeat).
      It is captured the second time in a row one token count arrives at the same addresses,
      and replayed only when every input is at exactly the address, with the shape, dtype and
      strides, it was captured on: it then reads what the caller passed now, as an eager call
      would, with no copy. It keeps no reference to the caller's tensors and never writes to
      them (the forward only reads its inputs), so a freed and reused address is only ever
      read when the caller passes a tensor there. With `out=`, the output buffer is one more
      captured address: the graph writes the result there, and nothing is cloned.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], device: torch.device) -> None:
        self._fn = fn
        self._device = device
        self._on_cuda = device.type == "cuda"
        self._graphs: dict[tuple, _Captured] = {}  # key -> copying graph
        self._direct: dict[tuple, _Captured] = {}  # where -> direct graph
        self._direct_per_key: dict[tuple, int] = {}
        self._last: dict[tuple, tuple] = {}  # key -> where the previous call's inputs were
        self._pool: object | None = None

    @property
    def captured_token_counts(self) -> list[int]:
        """Token counts that have a captured graph (ascending)."""
        return sorted({key[0] for key in self._graphs} | {where[2][0] for where in self._direct})

    @property
    def direct_graphs(self) -> int:
        """How many graphs read the caller's tensors in place (no input copy)."""
        return len(self._direct)

    def clear(self) -> None:
        self._graphs.clear()
        self._direct.clear()
        self._direct_per_key.clear()
        self._last.clear()
        self._pool = None

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
            cap = self._direct.get(self.where(inputs, out))
        except (AttributeError, TypeError):  # None or a non-tensor among the inputs
            return None
        if cap is None or (self._on_cuda and torch.cuda.is_current_stream_capturing()):
            return None  # inside someone else's capture the forward runs as usual
        cap.graph.replay()
        return cap.output.clone() if out is None else out

    def __call__(self, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        where = self.where(inputs, out)
        cap = self._direct.get(where)  # the hot case first: one signature, one lookup
        if cap is not None:  # direct: reads the caller's inputs (and writes `out`) in place
            cap.graph.replay()
            return cap.output.clone() if out is None else out
        base = self.key(inputs)
        key = base if out is None else (*base, "out")  # the last call's addresses, per kind of call
        if self._last.get(key) == where and self._direct_per_key.get(key, 0) < DIRECT_PER_TOKEN_COUNT:
            cap = self._direct[where] = self._capture(inputs, copy_inputs=False, out=out)
            self._direct_per_key[key] = self._direct_per_key.get(key, 0) + 1
            cap.graph.replay()
            return cap.output.clone() if out is None else out
        self._last[key] = where
        cap = self._graphs.get(base)  # copying graphs serve calls with and without `out`
        if cap is None:
            cap = self._graphs[base] = self._capture(inputs, copy_inputs=True)
        torch._foreach_copy_(cap.inputs, inputs)  # one call for all inputs, not one per tensor
        cap.graph.replay()
        return cap.output.clone() if out is None else out.copy_(cap.output)

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
        sig: list = []
        for t in inputs:
            sig += (t.data_ptr(), t.dtype, t.shape, t.stride())
        if out is not None:
            sig += (out.data_ptr(), out.dtype, out.shape, out.stride())
        return tuple(sig)

    def _capture(
        self, inputs: tuple[torch.Tensor, ...], copy_inputs: bool, out: torch.Tensor | None = None
    ) -> _Captured:
        static = tuple(t.clone() for t in inputs) if copy_inputs else inputs
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        fn = (lambda: self._fn(*static)) if out is None else (lambda: out.copy_(self._fn(*static)))
        graph, output = capture(fn, self._device, pool=self._pool)
        return _Captured(graph, static if copy_inputs else (), output)


def capture(
    fn: Callable[[], torch.Tensor], device: torch.device | None = None, warmup: int = 1, pool: object | None = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `fn()` into a CUDA graph: `warmup` calls first on a side stream (JIT compiles,
    workspace allocation), as torch's docs ask. Returns the graph and the captured output."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


def should_replay(limit: int, hidden: torch.Tensor) -> bool:
    """Whether this eager call goes through the graph cache."""
    return (
        limit > 0 and hidden.is_cuda and 0 < hidden.shape[0] <= limit and not torch.cuda.is_current_stream_capturing()
    )
