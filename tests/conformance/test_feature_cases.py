"""The `features` family reaches kernels that decline the base shape at the 512-wide one (session
45's audit: Ascend FuseEP's routed scaling never ran, since both fuse modes decline the base)."""

from __future__ import annotations

import moehal
from moehal.reference.experts import ReferenceExperts
from moehal_conformance.suite import Suite
from throwaway_plugin import throwaway_suite


class _WideOnly(ReferenceExperts):
    """Grouped-layout experts that decline the base shape's intermediate size of 64."""

    name, priority = "wideonly", 40

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "masked"]

    def check_shape(self, req):
        if req.config.intermediate_size % 128:
            return moehal.decline(f"intermediate_size={req.config.intermediate_size} is not a multiple of 128", "shape")
        return moehal.accept(predicate="shape")


class _AnyShape(ReferenceExperts):
    """Token-major experts that take any shape (as `cuda.triton` beside DeepGEMM)."""

    name, priority = "anyshape", 30

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "standard"]


def _suite() -> Suite:
    return throwaway_suite("wideonly", [_WideOnly(), _AnyShape()])


def test_features_run_at_the_wide_shape_for_kernels_declining_the_base():
    suite = _suite()
    feats = [c for c in suite.cases() if c.family == "features" and c.quant.name == "bf16"]
    mine = {c.id.split("/")[2]: c for c in feats if c.pipeline is not None and c.pipeline.main.name == "wideonly"}
    for name in ("biases", "routed_scaling", "weight_on_input", "ep_local_range"):
        c = mine[f"{name}_512"]
        assert c.config.hidden_size == 512 and c.config.intermediate_size == 512
    assert mine["routed_scaling_512"].config.routed_scaling_factor == 2.5
    assert mine["ep_local_range_512"].config.ep_rank == 1
    suite.run([mine["routed_scaling_512"], mine["weight_on_input_512"]])
    assert [r.status for r in suite.results] == ["pass", "pass"], [r.detail for r in suite.results]


def test_paths_the_base_shape_reaches_are_not_repeated_wide():
    feats = [c for c in _suite().cases() if c.family == "features" and "routed_scaling" in c.id]
    other = [c.id for c in feats if c.pipeline is not None and c.pipeline.main.name == "anyshape"]
    assert other and all("/routed_scaling/" in i for i in other), other
