"""Conformance's `tuned` family: kernels that run other code at real model shapes (tuned tables)
declare those shapes, and the suite proves them there. A kernel wrong only at its tuned shape
fails; a declaration the kernel then declines, or one that raises, fails too."""

from __future__ import annotations

import dataclasses

import moehal
import pytest
from moehal.interfaces import TunedShape
from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner
from moehal_conformance.suite import Suite
from throwaway_plugin import throwaway_suite

TUNED = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, max_tokens=64)
BF16 = moehal.QuantScheme.parse("bf16")


class _WrongAtTunedShapeRunner(ReferenceExpertsRunner):
    """Right at conformance's small shapes; at hidden 256 with a batch of more than 16 rows
    (the 'tuned tile' of this fake table) its output is off by 2%."""

    def apply(self, inp):
        out = super().apply(inp)
        if self.config.hidden_size == 256 and inp.topk_ids.numel() > 16:
            return dataclasses.replace(out, hidden=out.hidden * 1.02)
        return out


def _experts(name: str, runner=ReferenceExpertsRunner, raises: bool = False, declines: bool = False):
    class _Tuned(ReferenceExperts):
        priority = 40
        quant_schemes = frozenset({BF16})

        def input_formats(self, req):
            return [f for f in super().input_formats(req) if f.layout_name == "standard"]

        def build(self, req, fmt):
            return runner(req, fmt)

        def check_shape(self, req):
            if declines and req.config.hidden_size == 256:
                return moehal.decline("hidden 256 is not supported after all", "shape")
            return moehal.accept(predicate="shape")

        def tuned_shapes(self, req):
            if raises:
                raise RuntimeError("the table is corrupt")
            path = lambda t: t * TUNED.top_k > 16  # noqa: E731 - two 'tiles': up to 16 rows, and more
            return [TunedShape.covering("fake_model", TUNED, BF16, path, "a fake table")]

    _Tuned.name = name
    return _Tuned()


def _suite(name: str, experts) -> Suite:
    return throwaway_suite(name, [experts])


def test_covering_takes_the_smallest_batch_of_each_path():
    ts = TunedShape.covering("m", TUNED, BF16, lambda t: min(t // 10, 3), "tiles")
    assert ts.tokens == (1, 10, 20, 30)
    assert ts.why == "4 paths: tiles"
    with pytest.raises(ValueError, match="max_tokens"):
        TunedShape.covering("m", TUNED.with_(max_tokens=None), BF16, lambda t: 0)


def test_a_kernel_wrong_only_at_its_tuned_shape_fails_there():
    suite = _suite("tunedbug", _experts("tunedbug", _WrongAtTunedShapeRunner))
    tuned = [c for c in suite.cases() if c.family == "tuned"]
    assert [c.tokens for c in tuned] == [1, 9], [c.id for c in tuned]  # one batch per path
    assert all(c.config == TUNED and c.pipeline is not None for c in tuned)
    suite.run([c for c in suite.cases() if c.family in ("tuned", "matrix")])
    failed = {r.id for r in suite.results if r.status == "fail"}
    assert failed == {c.id for c in tuned if c.tokens == 9}, failed
    assert not suite.ok


def test_a_right_kernel_passes_its_tuned_cases(tmp_path):
    from moehal_conformance import report

    suite = _suite("tunedok", _experts("tunedok"))
    tuned = [c for c in suite.cases() if c.family == "tuned"]
    suite.run(tuned)
    assert [r.status for r in suite.results] == ["pass", "pass"], [(r.id, r.detail) for r in suite.results]
    md = report.to_markdown(suite)
    section = md.split("## Tuned shapes (each declared batch size)")[1].split("## Behaviour")[0]
    assert all(f"| {c.id} | pass |" in section for c in tuned), section
    assert tuned[0].id not in md.split("## Behaviour")[1].split("<details>")[0], "listed once, in its section"


def test_a_tuned_shape_the_kernel_declines_fails_with_the_reason():
    suite = _suite("tuneddecl", _experts("tuneddecl", declines=True))
    tuned = [c for c in suite.cases() if c.family == "tuned"]
    suite.run(tuned)
    assert tuned and {r.status for r in suite.results} == {"fail"}
    assert all("declares fake_model" in r.detail and "builds no pipeline" in r.detail for r in suite.results)


def test_a_declaration_that_raises_is_a_failure_naming_the_kernel():
    suite = _suite("tunedraise", _experts("tunedraise", raises=True))
    tuned = [c for c in suite.cases() if c.family == "tuned"]
    suite.run(tuned)
    assert [r.status for r in suite.results] == ["fail"]
    assert "tunedraise.tunedraise.tuned_shapes raised RuntimeError: the table is corrupt" in suite.results[0].detail


def test_the_reference_and_cpu_backends_declare_no_tuned_shapes():
    reg = moehal.discover()
    hw = moehal.detect("cpu")
    req = moehal.BuildRequest(moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64), BF16, hw)
    assert [i.qualname for i in (*reg.experts, *reg.fused) if i.tuned_shapes(req)] == []
