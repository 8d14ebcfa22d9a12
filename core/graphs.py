"""Eager forwards replayed from CUDA graphs: one capture per token count, for engines that do
not capture graphs themselves.

Why: an eager forward pays Python and launch overhead for every kernel it queues (hundreds of
microseconds on the CUDA backends, far above the tens that a decode step can afford). A CUDA
graph queues the whole forward with one launch. `MoELayer(..., cuda_graph_tokens=N)` (or
setting `layer.cuda_graph_tokens`) captures, on the first eager call with T <= N tokens, the
forward for that T and replays it on every later call with T tokens.

What a replay costs and assumes:
- The inputs are copied into the graph's static inputs (one `torch._foreach_copy_`) and the
  output is cloned: the caller's tensors are never captured, and the returned tensor is the caller's to
  keep, as in an ordinary eager call. The host cost of each part, measured on an H100 host:
  docs/device-runs/2026-11-23-session5.
- One capture per distinct token count, sharing one memory pool per layer; engines bucket
  their batch sizes, so the set stays small. Larger batches run eagerly: their GPU time
  dwarfs the launch overhead.
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
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


class GraphCache:
    """Per-token-count CUDA graphs of one forward function `fn(*tensors) -> Tensor`."""

    def __init__(self, fn: Callable[..., torch.Tensor], device: torch.device) -> None:
        self._fn = fn
        self._device = device
        self._graphs: dict[tuple, _Captured] = {}
        self._pool: object | None = None

    @property
    def captured_token_counts(self) -> list[int]:
        """Token counts that have a captured graph (ascending)."""
        return sorted({key[0] for key in self._graphs})

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        key = self.key(inputs)
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._graphs[key] = self._capture(inputs)
        torch._foreach_copy_(cap.inputs, inputs)  # one call for all inputs, not one per tensor
        cap.graph.replay()
        return cap.output.clone()

    @staticmethod
    def key(inputs: tuple[torch.Tensor, ...]) -> tuple:
        """One graph per token count and input dtypes: the caller (`MoELayer.forward`) checked
        the shapes against the layer's config, so these decide them (a cheaper key than every
        shape, on the hot path)."""
        return (inputs[0].shape[0], *[t.dtype for t in inputs])

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        static = tuple(t.clone() for t in inputs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, output = capture(lambda: self._fn(*static), self._device, pool=self._pool)
        return _Captured(graph, static, output)


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
        limit > 0
        and hidden.device.type == "cuda"
        and 0 < hidden.shape[0] <= limit
        and not torch.cuda.is_current_stream_capturing()
    )
