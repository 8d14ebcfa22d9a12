"""Shared fixtures: small random MoE problems.

Without a GPU the Triton kernels run under the interpreter: TRITON_INTERPRET=1 is set here,
before moehal is imported, since triton reads it when it decorates a kernel and each kernel
module once, at import (its `INTERPRETED`, which turns on the interpreter's workarounds;
`moehal.kernels.host.kernel_modules_interpreted`). Set later,
a single test file run without it mixed the two (session 54: an fp8 case 6% off)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moehal  # noqa: E402
import pytest  # noqa: E402


def pytest_sessionstart(session):
    """Under the interpreter, a Triton whose interpreter cannot run moehal's kernels (before 3.4;
    or before 3.7 with numpy 2.4, which a CUDA torch's pinned Triton can be) failed hundreds of
    tests one by one with one error: stop here instead, with the reason and its fixes."""
    from moehal.kernels.host import interpreter_too_old, interpreting

    why = interpreter_too_old() if interpreting() else None
    if why is not None:
        pytest.exit(
            f"TRITON_INTERPRET=1, but {why}. Nothing was run: fix the environment and run the tests again.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_report_header(config):
    return [
        f"moehal {moehal.__version__}, torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    ]


@pytest.fixture(autouse=True)
def _verify_fast_launches(monkeypatch):
    """On a GPU every fast Triton launch (keyed or pinned) in every test is checked against the
    compiled kernel Triton itself would pick (`moehal.kernels.launch.VERIFY`); a difference
    raises."""
    if torch.cuda.is_available():
        from moehal.kernels import launch

        monkeypatch.setattr(launch, "VERIFY", True)


@pytest.fixture(autouse=True)
def _caller_stream_restored():
    """On a GPU, a test that leaves a stream other than the default one current fails, naming
    itself (later tests would run on that stream and race with code that uses the default one),
    and the default stream is made current again."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        left = torch.cuda.current_stream()
        if left != torch.cuda.default_stream():
            torch.cuda.set_stream(torch.cuda.default_stream())
            pytest.fail(f"the test left {left} current, not the default stream")


@pytest.fixture
def registry():
    """A fresh registry loaded from the installed entry points, environment ignored."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    return reg


class FakeCudaGraph:
    """Stands in for a CUDA graph on the CPU: replay reruns the captured function and writes
    the captured output in place, as a graph writes where it was captured writing."""

    def __init__(self, fn, output: torch.Tensor) -> None:
        self._fn, self._output, self.replays = fn, output, 0

    def replay(self) -> None:
        self.replays += 1
        # a graph's kernels write its output whatever the mode it was captured in (torch's
        # check on in-place updates of inference tensors is no part of a replay)
        with torch.inference_mode(self._output.is_inference()):
            self._output.copy_(self._fn())


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """`moehal.graphs.capture` (and the graph memory pool) stood in for on the CPU, so
    `GraphCache`'s own bookkeeping runs there unchanged."""
    from moehal import graphs

    def capture(fn, device=None, warmup: int = 1, pool=None):
        output = fn()
        return FakeCudaGraph(fn, output), output

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())


@pytest.fixture
def outranked_reference_registry():
    """A fresh registry: the reference backend, and a stand-in vendor (`vendorlike`) whose
    single-device dispatcher `vendorlike.fast_local` outranks `reference.local`, as
    `cuda.permute` does on a GPU. For checks that an oracle stays the reference pipeline."""
    import moehal.reference.plugin
    from moehal.reference.dispatcher import ReferenceDispatcher

    class Outranking(ReferenceDispatcher):
        name = "fast_local"
        priority = 50

    class Plugin:
        @moehal.hookimpl
        def moehal_backend_info(self):
            return moehal.BackendInfo("vendorlike", "0", "test plugin")

        @moehal.hookimpl
        def moehal_dispatchers(self):
            return [Outranking()]

    reg = moehal.Registry(moehal.Settings())
    reg.register(moehal.reference.plugin, "reference")
    reg.register(Plugin(), "vendorlike")
    return reg


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one rank in this process (torch.distributed's WORLD), for checks
    of EP code that need a group but no peers: every collective hands the rows back."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=20),
    )  # fmt: skip
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
