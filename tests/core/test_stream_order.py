"""`moehal.stream_order`: a forward on another stream than the last one waits for the last
one's work (an event, no host sync); captures are left alone; one thread at a time.

CPU tests drive the logic with stand-in streams and events; the conformance check
`two_streams` runs it on a GPU (tests/conformance/test_suite.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from moehal import stream_order
from moehal.stream_order import StreamOrder


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.waited: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)


class _Event:
    def __init__(self) -> None:
        self.recorded_on: _Stream | None = None

    def record(self, stream: _Stream) -> None:
        self.recorded_on = stream


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in device: `gpu.current` is its current stream, `gpu.capturing` whether a capture
    runs on it."""
    state = type("Gpu", (), {})()
    state.current = _Stream(1)
    state.capturing = False
    state.device, state.set_to = 0, []  # the current device, and each `set_device` call

    def set_device(index: int) -> None:
        state.device = index
        state.set_to.append(index)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: state.current)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(stream_order, "_raw_stream_getter", lambda: lambda index: state.current.cuda_stream)
    monkeypatch.setattr(stream_order, "_device_getter", lambda: lambda: state.device)
    return state


def _run(order: StreamOrder) -> None:
    with order:
        pass


def test_the_first_stream_waits_for_nothing_and_the_same_stream_never_waits(gpu):
    order = StreamOrder(0)
    _run(order)
    _run(order)
    assert gpu.current.waited == [] and order.switches == 1


def test_another_stream_waits_for_the_work_queued_on_the_last_one(gpu):
    order = StreamOrder(0)
    first = gpu.current
    _run(order)
    gpu.current = second = _Stream(2)
    _run(order)
    assert len(second.waited) == 1 and second.waited[0].recorded_on is first
    gpu.current = first  # and back: the first stream now waits for the second's forward
    _run(order)
    assert len(first.waited) == 1 and first.waited[0].recorded_on is second
    assert order.switches == 3


def test_a_capture_neither_waits_nor_becomes_the_last_stream(gpu):
    order = StreamOrder(0)
    first = gpu.current
    _run(order)
    gpu.current, gpu.capturing = _Stream(3), True
    _run(order)
    assert gpu.current.waited == []
    gpu.current, gpu.capturing = first, False
    _run(order)  # still the last stream: nothing to wait for
    assert first.waited == [] and order.switches == 1


def test_switched_off_nothing_waits(gpu, monkeypatch):
    monkeypatch.setattr(stream_order, "ENABLED", False)
    order = StreamOrder(0)
    _run(order)
    gpu.current = _Stream(2)
    _run(order)
    assert gpu.current.waited == [] and order.switches == 0


def test_another_thread_queues_only_after_the_forward_in_progress(gpu):
    order = StreamOrder(0)
    inside, release, entered = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with order:
            inside.set()
            release.wait(5)

    def second() -> None:
        with order:
            entered.set()

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(5)
    b = threading.Thread(target=second)
    b.start()
    assert not entered.wait(0.2)  # blocked while the first forward queues its kernels
    release.set()
    a.join(5)
    b.join(5)
    assert entered.is_set()


def test_the_order_is_reentrant_and_released_on_errors(gpu):
    order = StreamOrder(0)
    with pytest.raises(RuntimeError), order:
        with order:  # a forward inside a forward (a graph capture's warmup) does not deadlock
            raise RuntimeError("kernel failed")
    done = threading.Event()
    t = threading.Thread(target=lambda: (order.__enter__(), order.__exit__(), done.set()))
    t.start()
    t.join(5)
    assert done.is_set()


def test_the_device_is_current_inside_and_the_callers_after(gpu):
    order = StreamOrder(1)  # a layer on cuda:1, called while cuda:0 is current
    with order:
        assert gpu.device == 1
        with order:  # nested: the device stays, and the outer entry restores the caller's
            assert gpu.device == 1
        assert gpu.device == 1
    assert gpu.device == 0 and gpu.set_to == [1, 0]
    with pytest.raises(RuntimeError), order:
        raise RuntimeError("kernel failed")
    assert gpu.device == 0


def test_a_layer_on_the_current_device_never_sets_it(gpu):
    order = StreamOrder(0)
    _run(order)
    _run(order)
    assert gpu.set_to == []


def test_one_order_per_device(gpu, monkeypatch):
    monkeypatch.setattr(stream_order, "_ORDERS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    one = stream_order.for_device(torch.device("cuda", 1))
    assert stream_order.for_device(torch.device("cuda")) is one
    assert stream_order.for_device(torch.device("cuda", 0)) is not one


def test_layers_off_cuda_have_no_order():
    import moehal

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    layer = moehal.MoELayer(cfg, quant="bf16", backend="reference", device="cpu")
    assert layer._order is None
