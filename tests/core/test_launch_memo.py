"""`moehal.graphs.LaunchMemo` on the CPU: a stand-in CUDA graph records the launches made while
it captures and reruns them on replay, as a real graph does, so the memo's choices (when to
capture, when to replay, when a call must run directly) are checked against direct calls."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from moehal import graphs


class FakeGraph:
    capturing: FakeGraph | None = None  # the graph now capturing (one stream here)

    def __init__(self) -> None:
        self.ops: list[Any] = []

    def capture_begin(self, pool: object = None, capture_error_mode: str = "global") -> None:
        FakeGraph.capturing = self

    def capture_end(self) -> None:
        FakeGraph.capturing = None

    def replay(self) -> None:
        for op in self.ops:
            op()


class FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"outer_capture": False}
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["outer_capture"])
    monkeypatch.setattr(graphs, "MEMO_ENABLED", True)  # the default, stated: tests must not depend on it
    FakeGraph.capturing = None
    return state


class Gemm:
    """The memoized call: `d[:rows] = a[:rows] * 2 + em`, rows read "on the GPU" from `mm`.
    While a graph captures, the work is recorded, not done."""

    def __init__(self) -> None:
        self.direct = 0

    def __call__(self, a: torch.Tensor, d: torch.Tensor, mm: torch.Tensor, em: int) -> None:
        def op() -> None:
            rows = int(mm.item())
            d[:rows] = a[:rows] * 2 + em

        if FakeGraph.capturing is not None:
            FakeGraph.capturing.ops.append(op)
        else:
            self.direct += 1
            op()


def test_the_second_call_in_a_row_captures_and_later_calls_replay_with_current_contents(fake_cuda):
    gemm = Gemm()
    memo = graphs.LaunchMemo(gemm)
    a, d, mm = torch.randn(8, 4), torch.zeros(8, 4), torch.tensor([8])
    memo(a, d, mm, 1)
    memo(a, d, mm, 1)  # same signature twice in a row: runs, then captures
    assert (gemm.direct, memo.replays, len(memo._graphs)) == (2, 0, 1)
    a.copy_(torch.randn(8, 4))  # new contents, same tensor: a replay must read them
    mm.fill_(5)  # and the row count, read "on the GPU"
    d.zero_()
    memo(a, d, mm, 1)
    assert (gemm.direct, memo.replays) == (2, 1)
    assert torch.equal(d[:5], a[:5] * 2 + 1) and torch.equal(d[5:], torch.zeros(3, 4))


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda a, d, mm: (a.clone(), d, mm, 1), id="another-address"),
        pytest.param(lambda a, d, mm: (a[:4], d, mm, 1), id="another-shape-same-address"),
        pytest.param(lambda a, d, mm: (a.t().contiguous().t(), d, mm, 1), id="another-stride"),
        pytest.param(lambda a, d, mm: (a.double(), d.double(), mm, 1), id="another-dtype"),
        pytest.param(lambda a, d, mm: (a, d, mm, 2), id="another-host-argument"),
    ],
)
def test_a_call_unlike_the_captured_one_runs_directly(fake_cuda, other):
    gemm = Gemm()
    memo = graphs.LaunchMemo(gemm)
    a, d, mm = torch.randn(8, 4), torch.zeros(8, 4), torch.tensor([4])
    memo(a, d, mm, 1)
    memo(a, d, mm, 1)
    args = other(a, d, mm)
    args[1].zero_()
    memo(*args)
    assert (gemm.direct, memo.replays) == (3, 0)
    x, y, _, em = args
    assert torch.equal(y[:4], x[:4] * 2 + em)


def test_signatures_taking_turns_each_capture_on_their_second_call(fake_cuda):
    """A layer's GEMM1 and GEMM2 share one memo and alternate: each is captured on its second
    call and replayed from its third (session 15's "twice in a row" rule never captured them)."""
    gemm = Gemm()
    memo = graphs.LaunchMemo(gemm)
    a, b, d1, d2, mm = torch.randn(8, 4), torch.randn(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), torch.tensor([8])
    for _ in range(2):
        memo(a, d1, mm, 1)
        memo(b, d2, mm, 1)
    assert (gemm.direct, memo.replays, len(memo._graphs)) == (4, 0, 2)
    a.copy_(torch.randn(8, 4))
    b.copy_(torch.randn(8, 4))
    for _ in range(3):
        memo(a, d1, mm, 1)
        memo(b, d2, mm, 1)
    assert (gemm.direct, memo.replays) == (4, 6)
    assert torch.equal(d1, a * 2 + 1) and torch.equal(d2, b * 2 + 1)


def test_signatures_called_once_never_capture_and_are_forgotten_past_capacity(fake_cuda):
    gemm = Gemm()
    memo = graphs.LaunchMemo(gemm, capacity=4)
    a, d, mm = torch.randn(8, 4), torch.zeros(8, 4), torch.tensor([8])
    for em in range(10):  # ten one-off calls (prefill batches of new sizes, say): no capture
        memo(a, d, mm, em)
    assert (len(memo._graphs), len(memo._seen)) == (0, 4)
    memo(a, d, mm, 0)  # its first call was 10 distinct signatures ago: forgotten, not captured
    assert len(memo._graphs) == 0
    memo(a, d, mm, 9)  # among the last 4: captured
    assert len(memo._graphs) == 1 and gemm.direct == 12


def test_inside_another_capture_the_call_runs_as_usual(fake_cuda):
    gemm = Gemm()
    memo = graphs.LaunchMemo(gemm)
    a, d, mm = torch.randn(8, 4), torch.zeros(8, 4), torch.tensor([8])
    memo(a, d, mm, 1)
    memo(a, d, mm, 1)
    fake_cuda["outer_capture"] = True  # an engine captures its forward: record the launch itself
    memo(a, d, mm, 1)
    assert (gemm.direct, memo.replays) == (3, 0)


def test_a_failed_capture_switches_the_memo_off_and_says_why(fake_cuda):
    calls = []

    def syncs_on_the_host(a: torch.Tensor, d: torch.Tensor) -> None:
        if FakeGraph.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        calls.append(1)
        d.copy_(a)

    memo = graphs.LaunchMemo(syncs_on_the_host)
    a, d = torch.randn(3), torch.zeros(3)
    for _ in range(4):
        memo(a, d)
    assert len(calls) == 4 and torch.equal(d, a)
    assert memo.off_reason is not None and "not permitted" in memo.off_reason
    assert FakeGraph.capturing is None  # the capture was ended


def test_the_context_joins_the_signature_and_capacity_drops_the_oldest(fake_cuda):
    gemm = Gemm()
    sms = [132]
    memo = graphs.LaunchMemo(gemm, capacity=2, context=lambda: sms[0])
    a, d, mm = torch.randn(8, 4), torch.zeros(8, 4), torch.tensor([8])
    for em in (1, 2, 3):  # three signatures, each captured: the first is dropped
        memo(a, d, mm, em)
        memo(a, d, mm, em)
    assert len(memo._graphs) == 2
    memo(a, d, mm, 3)
    assert memo.replays == 1
    sms[0] = 100  # an engine gave DeepGEMM fewer SMs: the graph of 132 no longer applies
    memo(a, d, mm, 3)
    assert memo.replays == 1 and gemm.direct == 7


def test_replays_are_on_by_default():
    assert graphs.MEMO_ENABLED is True  # session 16's A/B: 8-12% less eager host time where DeepGEMM runs


def test_switched_off_every_call_runs_directly(fake_cuda, monkeypatch):
    monkeypatch.setattr(graphs, "MEMO_ENABLED", False)
    gemm = Gemm()
    memo = graphs.LaunchMemo(gemm)
    a, d, mm = torch.randn(8, 4), torch.zeros(8, 4), torch.tensor([8])
    for _ in range(3):
        memo(a, d, mm, 1)
    assert (gemm.direct, memo.replays, len(memo._graphs)) == (3, 0, 0)


def test_a_cause_shared_by_many_memos_warns_once_naming_the_launch_and_the_switch(fake_cuda, monkeypatch, caplog):
    """A model's 61 layers hold two memos each: a capture failure they share gave 122 identical
    warnings, none saying which launch or how to turn the memos off (an observability review)."""
    import logging

    monkeypatch.setattr(graphs, "_WARNED", set())

    def syncs_on_the_host(a: torch.Tensor, d: torch.Tensor) -> None:
        if FakeGraph.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        d.copy_(a)

    a, d = torch.randn(3), torch.zeros(3)
    with caplog.at_level(logging.DEBUG, logger="moehal.graphs"):
        for _ in range(5):
            memo = graphs.LaunchMemo(syncs_on_the_host)
            memo(a, d)
            memo(a, d)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and len([r for r in caplog.records if "stops replaying" in r.message]) == 5
    assert "syncs_on_the_host" in warned[0].message and "MEMO_ENABLED = False" in warned[0].message
