"""One order for moehal's forwards on a GPU, whichever stream or thread queues them.

Why: the CUDA and ROCm paths keep their scratch process-wide, one set per device and layer
shape (permute workspaces, activation rows, arrival counters: `moehal.kernels.triton_permute`),
so memory stays flat in the number of layers. Two forwards of one shape whose kernels overlap on
two streams (two-batch overlap, a side stream an engine runs a layer on, two threads) would
write each other's rows: a wrong result and no error. So every forward of a layer on a CUDA
device runs inside its device's `StreamOrder`:

- on the stream moehal used last on that device, nothing happens but one query and a compare;
- on another stream, that stream first waits for everything queued so far on the last one (an
  event recorded there: no host sync), and becomes the last one;
- one lock per device keeps another thread from queueing a forward while this one queues its
  kernels, so the event covers whole forwards;
- the device is made the current one while the forward queues, and the caller's restored
  after. Triton launches on the current device, whatever device its tensors are on: a layer on
  `cuda:1` called while `cuda:0` is current (a model spread over GPUs in one process, as
  transformers' `device_map="auto"` does) would launch its kernels on the wrong GPU.

Forwards on one device thus run in the order they were queued, as they do on one stream. Two
forwards on two streams no longer overlap each other (their other work still does).

The last stream is kept until a forward runs on another one, which then records an event on
it: a `torch.cuda.ExternalStream` that a forward ran on must outlive that (torch's own streams
are never destroyed).

Not covered: CUDA graphs an engine captures and replays itself. A capture is skipped here (its
stream waited for the caller's when it began), so a replay of such a graph runs in the order the
engine gives it. `moehal.graphs`' own replays go through the layer's forward, which is ordered.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

# On by default. False: forwards queue on their stream unordered (a benchmark or a probe of the
# race this prevents); layers read it at every forward.
ENABLED = True


def _device_getter() -> Any:
    """The current CUDA device's index, as cheaply as torch gives it (what Triton's launcher
    asks for at every launch)."""
    return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _raw_stream_getter() -> Any:
    """The cheapest query of a device's current stream: torch's raw handle (what Triton's
    launcher asks for at every launch), or the stream object's handle where torch lacks it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class StreamOrder:
    """The order of moehal's forwards on one CUDA device, which is current inside (see the
    module's note). A context manager: `with order: <queue a forward>`. Re-entrant in one
    thread."""

    __slots__ = ("index", "switches", "_lock", "_last", "_last_stream", "_raw", "_device", "_callers")

    def __init__(self, index: int) -> None:
        self.index = index
        self.switches = 0  # stream changes ordered (a capture's stream is not one)
        self._lock = threading.RLock()
        self._last: int | None = None  # the raw handle of the stream moehal queued on last
        self._last_stream: torch.cuda.Stream | None = None
        self._raw = _raw_stream_getter()
        self._device = _device_getter()
        self._callers: list[int] = []  # the current device at each entry (nested entries too)

    def __enter__(self) -> StreamOrder:
        self._lock.acquire()
        try:
            caller = self._device()
            if caller != self.index:
                torch.cuda.set_device(self.index)
            self._callers.append(caller)
        except BaseException:
            self._lock.release()
            raise
        try:
            if ENABLED and self._raw(self.index) != self._last:
                self._switch()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        caller = self._callers.pop()
        try:
            if caller != self.index:
                torch.cuda.set_device(caller)
        finally:
            self._lock.release()

    def _switch(self) -> None:
        """The current stream waits for the work queued on the last one, and becomes it."""
        if torch.cuda.is_current_stream_capturing():
            # Waiting inside a capture on an event recorded outside it is illegal; the capture's
            # stream waited for the caller's when it began, and its replays are ordered by
            # whoever replays them.
            return
        current = torch.cuda.current_stream(self.index)
        if self._last_stream is not None:
            done = torch.cuda.Event()
            done.record(self._last_stream)
            current.wait_event(done)
        self._last, self._last_stream = current.cuda_stream, current
        self.switches += 1


_ORDERS: dict[int, StreamOrder] = {}
_ORDERS_LOCK = threading.Lock()


def for_device(device: torch.device) -> StreamOrder:
    """The one `StreamOrder` of a CUDA device (`cuda` alone names the current one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _ORDERS_LOCK:
        order = _ORDERS.get(index)
        if order is None:
            order = _ORDERS[index] = StreamOrder(index)
        return order
