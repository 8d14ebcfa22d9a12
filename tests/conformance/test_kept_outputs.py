"""The kept_outputs check: a forward's output keeps its values through later forwards of the same
layer and of other layers of its shape (engines hold one while the next micro-batch runs)."""

from __future__ import annotations

import torch
from moehal.reference.dispatcher import LocalDispatchRunner, ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts
from moehal_conformance.cases import BEHAVIOUR_CHECKS
from throwaway_plugin import throwaway_suite

_SHARED: dict[tuple, torch.Tensor] = {}  # one buffer per layer shape, as process-wide scratch is


class _KeptRunner(LocalDispatchRunner):
    """Combines into a buffer and returns a view of it: per runner, or shared by the layers of a
    shape (`shared`)."""

    shared = False

    def combine(self, expert_out, handle):
        y = super().combine(expert_out, handle)
        if self.shared:
            buf = _SHARED.setdefault((y.shape[1], y.dtype), torch.empty(64, y.shape[1], dtype=y.dtype))
        else:
            buf = self.__dict__.setdefault("buf", torch.empty(64, y.shape[1], dtype=y.dtype))
        return buf[: y.shape[0]].copy_(y)


class _SharedRunner(_KeptRunner):
    shared = True


def _results(runner: type | None) -> list:
    name = {None: "fresh", _KeptRunner: "kept", _SharedRunner: "shared"}[runner]

    class _Dispatcher(ReferenceDispatcher):
        def build(self, req, fmt):
            return runner(req, fmt) if runner is not None else super().build(req, fmt)

    class _Experts(ReferenceExperts):
        def input_formats(self, req):
            return [f for f in super().input_formats(req) if f.layout_name == "standard" and not f.is_quantized]

    _Dispatcher.name, _Dispatcher.priority = "keeper", 40
    _Experts.name, _Experts.priority = "experts", 40
    suite = throwaway_suite(name, [_Experts()], [_Dispatcher()])
    cases = [c for c in suite.cases() if c.check == "kept_outputs" and c.quant.name == "bf16"]
    assert cases and all(c.pipeline is not None and c.pipeline.dispatcher.name == "keeper" for c in cases)
    suite.run(cases)
    return suite.results


def test_the_check_runs_per_claimed_scheme():
    assert "kept_outputs" in BEHAVIOUR_CHECKS


def test_fresh_outputs_pass():
    results = _results(None)
    assert {r.status for r in results} == {"pass"}, [r.detail for r in results]
    assert results[0].detail.startswith("every output kept its bits through 3 later forwards; the first: rel_l2")


def test_an_output_in_a_buffer_the_layer_keeps_fails():
    results = _results(_KeptRunner)
    assert {r.status for r in results} == {"fail"}
    assert results[0].detail.startswith("the first output changed when the same layer on other inputs ran")


def test_an_output_in_a_buffer_the_layers_of_a_shape_share_fails_on_the_second_layer():
    results = _results(_SharedRunner)
    assert {r.status for r in results} == {"fail"}
    # the same layer overwrote it first; the second layer then overwrote every output held
    assert "output 2 (the same layer on other inputs) changed when a second layer of this shape ran" in (
        results[0].detail
    ), results[0].detail
