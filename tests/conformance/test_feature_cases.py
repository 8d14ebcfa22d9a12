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


def test_shapes_and_routing_run_at_the_wide_shape_for_kernels_declining_the_base():
    """A fused forward with minimum sizes was `verified` with no shapes or routing case: a kernel
    that dropped every slot past the 8th passed (the vendor-onboarding review's top_k=10)."""
    suite = _suite()
    mine = {c.id.split("/")[2] for c in suite.cases() if c.pipeline is not None and c.pipeline.main.name == "wideonly"}
    for name in ("tokens_0", "tokens_1", "top_k_10", "experts_60", "one_expert"):
        assert f"{name}_512" in mine, sorted(mine)
    assert {"softmax_fp32_logits_512", "deepseek_v3_bf16_logits_512"} <= mine
    other = [c.id for c in suite.cases() if c.family == "shapes" and c.pipeline and c.pipeline.main.name == "anyshape"]
    assert other and not any("_512/" in i for i in other), other  # the base shape reached it
    top_k_10 = [c for c in suite.cases() if "/top_k_10_512/" in c.id and c.pipeline.main.name == "wideonly"]
    suite.run(top_k_10)
    assert [r.status for r in suite.results] == ["pass"] * len(top_k_10), [r.detail for r in suite.results]


class _RaisesAt60(ReferenceExperts):
    """A vendor bug: the shape check raises (not declines) for one expert count."""

    name, priority = "raises60", 40

    def check_shape(self, req):
        if req.config.num_experts == 60:
            raise RuntimeError("table lookup for 60 experts")
        return moehal.accept(predicate="shape")


def test_a_check_that_raises_for_one_config_fails_that_case_and_the_rest_run():
    """It aborted the whole run with no report ('the suite could not compute its cases')."""
    suite = throwaway_suite("raises60", [_RaisesAt60()])
    cases = suite.cases()
    broken = [c for c in cases if c.error is not None]
    assert broken and all("experts_60" in c.id for c in broken), [c.id for c in broken]
    assert any(c.pipeline is not None and c.pipeline.main.name == "raises60" for c in cases)
    suite.run(broken[:1])
    (res,) = suite.results
    assert res.status == "fail" and "a capability check raised for" in res.detail and "60 experts" in res.detail
