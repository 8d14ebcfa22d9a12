"""`moehal.graphs.GraphCache`'s choices, on the CPU: which graph a call captures or replays,
where its result lands, and that a miss allocates once. CUDA graphs are stood in for by a
replay that reruns the captured function into the captured output, and the allocator by a
script of output buffers; `tests/cuda/test_gpu.py` runs the real thing on a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from moehal import graphs
from moehal.graphs import DIRECT_PER_TOKEN_COUNT, GraphCache


class _FakeGraph:
    def __init__(self, fn, output: torch.Tensor) -> None:
        self._fn, self._output, self.replays = fn, output, 0

    def replay(self) -> None:
        self.replays += 1
        self._output.copy_(self._fn())  # a CUDA graph writes where it was captured writing


def _fake_capture(fn, device=None, warmup: int = 1, pool=None):
    output = fn()
    return _FakeGraph(fn, output), output


class _Allocator:
    """Hands out the scripted buffers for each new output, counting the allocations."""

    def __init__(self, script: Iterator[torch.Tensor]) -> None:
        self.script, self.calls = script, 0

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.calls += 1
        return next(self.script)


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * 2 + w.sum(dim=1, keepdim=True)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(graphs, "capture", _fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())


def _cache(monkeypatch, buffers: list[torch.Tensor], cycle: bool = True) -> tuple[GraphCache, _Allocator]:
    def script() -> Iterator[torch.Tensor]:
        while True:
            yield from buffers
            if not cycle:
                return

    alloc = _Allocator(script())
    monkeypatch.setattr(GraphCache, "_fresh_output", staticmethod(alloc))
    return GraphCache(_forward, torch.device("cpu")), alloc


def _call(cache: GraphCache, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """What `MoELayer.forward` does: the direct replay first, then (its checks and) the cache."""
    y = cache.replay_direct((x, w), out)
    return y if y is not None else cache(x, w, out=out)


def test_an_output_address_that_recurs_gets_a_graph_that_writes_it(monkeypatch, fake_cuda):
    a = torch.empty(3, 4)
    cache, alloc = _cache(monkeypatch, [a])  # the caller drops each result: same address every call
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(5):
        x.copy_(torch.randn(3, 4))  # refilled in place, as an engine's buffers are
        before = alloc.calls
        y = _call(cache, x, w)
        assert y is a and torch.equal(y, _forward(x, w))
        assert alloc.calls - before == 1, "one output allocation per call, hit or miss"
    # call 1 copied into a graph's own inputs; call 2 captured the graph writing `a` in place
    assert cache.direct_graphs == 1 and cache.output_writing_graphs == 1
    assert cache.captured_token_counts == [3]


def test_outputs_the_caller_keeps_are_copied_out_and_never_written_again(monkeypatch, fake_cuda):
    bufs = [torch.empty(3, 4) for _ in range(5)]
    cache, _ = _cache(monkeypatch, bufs, cycle=False)  # every output at a new address
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    kept = []
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        y = _call(cache, x, w)
        assert torch.equal(y, _forward(x, w))
        kept.append((y, y.clone()))
    # inputs in place from call 2 on: a graph that reads them in place, its output copied out
    assert cache.direct_graphs == 1 and cache.output_writing_graphs == 0
    for y, then in kept:
        assert torch.equal(y, then)


def test_outputs_alternating_between_two_buffers_are_written_in_place(monkeypatch, fake_cuda):
    """A residual add keeps the previous result alive while the next is allocated."""
    a, b = torch.empty(3, 4), torch.empty(3, 4)
    cache, _ = _cache(monkeypatch, [a, b])
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(8):
        x.copy_(torch.randn(3, 4))
        y = _call(cache, x, w)
        assert torch.equal(y, _forward(x, w))
    # one graph reading the inputs in place, then one writing each of the two buffers
    assert cache.direct_graphs == 3 and cache.output_writing_graphs == 2
    writers = [cap.graph for cap in cache._direct.values() if cap.output is None]
    replays = [g.replays for g in writers]
    y = _call(cache, x, w)
    assert y is a or y is b
    assert sum(g.replays for g in writers) == sum(replays) + 1  # served by a writing graph


def test_out_gets_its_own_graph_and_new_inputs_are_copied_in(monkeypatch, fake_cuda):
    cache, alloc = _cache(monkeypatch, [torch.empty(3, 4)])
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    out = torch.empty(3, 4)
    for _ in range(3):
        x.copy_(torch.randn(3, 4))
        assert _call(cache, x, w, out=out) is out
        assert torch.equal(out, _forward(x, w))
    assert cache.output_writing_graphs == 1 and alloc.calls == 0  # `out=` allocates nothing
    # other input tensors every call: copied into the copying graph's inputs
    for _ in range(3):
        x2, w2 = torch.randn(3, 4), torch.randn(3, 2)
        assert torch.equal(_call(cache, x2, w2), _forward(x2, w2))
    assert cache.direct_graphs == 1


def test_direct_graphs_per_token_count_are_bounded(monkeypatch, fake_cuda):
    bufs = [torch.empty(3, 4) for _ in range(4 * DIRECT_PER_TOKEN_COUNT + 4)]
    cache, _ = _cache(monkeypatch, bufs)
    for _ in range(2 * DIRECT_PER_TOKEN_COUNT + 2):  # new input tensors, each passed twice in a row
        x, w = torch.randn(3, 4), torch.randn(3, 2)
        for _ in range(2):
            assert torch.equal(_call(cache, x, w), _forward(x, w))
    assert cache.direct_graphs == DIRECT_PER_TOKEN_COUNT
    cache.clear()
    assert cache.direct_graphs == 0 and cache.captured_token_counts == []
