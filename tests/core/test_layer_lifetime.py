"""A layer its owner drops is freed at once, its weights and graph caches with it: no reference
cycle that waits for the garbage collector. An engine that swaps weights or unloads a model
empties torch's cache right after dropping its layers; a cycle kept every old layer's weights
until the next full collection (a load-cost review: 16 of 16 layers still alive three weight
syncs later in the transformers integration)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import moehal
import pytest
import torch
from moe_testing import build_problem
from moehal.graphs import GraphCache, LaunchMemo


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


CFG = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)


@pytest.mark.parametrize("layout", ["standard", "masked", "contiguous"])
def test_a_dropped_reference_layer_is_freed_without_the_collector(layout: str) -> None:
    w, x, ids, wts = build_problem(CFG, moehal.QuantScheme.parse("bf16"), 5, seed=1)
    with _collector_off():
        layer = moehal.MoELayer(CFG, "bf16", backend="reference", device="cpu", layout=layout)
        layer.load_weights(w)
        assert layer(x, ids, wts).shape == x.shape
        held = weakref.ref(layer)
        del layer
        assert held() is None, [type(r).__name__ for r in gc.get_referrers(held())]


def test_a_dropped_triton_layer_is_freed_without_the_collector() -> None:
    pytest.importorskip("triton")
    from _rocm_testing import DEVICE, problem, triton_registry

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float32)
    w, x, ids, wts = problem(cfg, "bf16", 5)
    with _collector_off():
        layer = moehal.MoELayer(cfg, "bf16", backend="tritonmoe", device=DEVICE, registry=triton_registry())
        layer.load_weights(w)
        assert layer(x, ids, wts).shape == x.shape
        held = weakref.ref(layer)
        del layer
        assert held() is None, [type(r).__name__ for r in gc.get_referrers(held())]


class _Owner:
    """Keeps caches of its own methods, as a layer keeps its forward's graphs and DeepGEMM's
    ops their launch memos."""

    def __init__(self) -> None:
        self.graphs = GraphCache(self.forward, torch.device("cpu"))
        self.memo = LaunchMemo(self.launch)
        self.launched = 0

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return x + 1

    def launch(self) -> None:
        self.launched += 1


def test_caches_of_an_owners_own_methods_do_not_keep_it_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    from moehal import graphs

    monkeypatch.setattr(graphs, "MEMO_ENABLED", False)  # (no GPU: the memo calls through)
    with _collector_off():
        owner = _Owner()
        owner.memo()
        assert owner.launched == 1
        held = weakref.ref(owner)
        del owner
        assert held() is None
