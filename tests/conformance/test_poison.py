"""Conformance poisons fresh allocations (`moehal.poison`), so a kernel reading memory
it never wrote fails every run rather than when the allocator happens to hand back garbage
(session 45's mutation audit: an unwritten sort sentinel passed whenever the freed memory held
a harmless value)."""

from __future__ import annotations

import moehal
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moehal.formats import StandardOutput
from moehal.poison import INT_POISON, poison_, poisoned
from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner
from moehal_conformance.suite import Suite
from throwaway_plugin import throwaway_suite

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ONE_BYTE_FLOATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def _is_poisoned(t: torch.Tensor) -> bool:
    if t.dtype == torch.bool:
        return bool(t.all())
    if t.dtype == torch.float4_e2m1fn_x2:
        return bool((t.view(torch.uint8) == 0xFF).all())
    if t.dtype.is_floating_point:
        return bool(t.float().isnan().all())
    return bool((t == INT_POISON).all())


@pytest.mark.parametrize("dtype", FLOATS + ONE_BYTE_FLOATS + INTS + [torch.bool, torch.float4_e2m1fn_x2], ids=str)
def test_every_dtype_gets_its_poison(dtype):
    zeros = torch.zeros(3, 5, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(3, 5).to(dtype)
    assert _is_poisoned(poison_(zeros))


def test_one_byte_floats_are_nan_in_every_encoding():
    for dtype in ONE_BYTE_FLOATS:
        assert poison_(torch.empty(4, dtype=dtype)).float().isnan().all(), dtype


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    dtype=st.sampled_from(FLOATS + ONE_BYTE_FLOATS + INTS + [torch.bool]),
    maker=st.sampled_from(["empty", "empty_like", "new_empty", "empty_strided"]),
)
def test_every_empty_family_allocation_is_poisoned(shape, dtype, maker):
    base = torch.ones(2, dtype=torch.float32)
    with poisoned() as mode:
        if maker == "empty":
            t = torch.empty(*shape, dtype=dtype)
        elif maker == "empty_like":
            t = torch.empty_like(torch.ones(shape).to(dtype))
        elif maker == "new_empty":
            t = base.new_empty(shape, dtype=dtype)
        else:  # column-major strides: the fill must reach every element, not a prefix
            strides = [1] * len(shape)
            for d in range(1, len(shape)):
                strides[d] = strides[d - 1] * max(shape[d - 1], 1)
            t = torch.empty_strided(shape, strides, dtype=dtype)
    assert mode is not None and mode.poisoned >= 1
    assert t.numel() == 0 or _is_poisoned(t)


def test_other_ops_and_their_results_are_untouched():
    x = torch.arange(6.0).reshape(2, 3)
    with poisoned() as mode:
        zeros, full = torch.zeros(4), torch.full((2,), 7, dtype=torch.int32)
        prod, summed, cat = x @ x.T, x.sum(0), torch.cat([x, x])
    assert mode is not None
    assert torch.equal(zeros, torch.zeros(4)) and torch.equal(full, torch.full((2,), 7, dtype=torch.int32))
    assert torch.equal(prod, torch.tensor([[5.0, 14.0], [14.0, 50.0]]))
    assert torch.equal(summed, torch.tensor([3.0, 5.0, 7.0])) and torch.equal(cat[2:], x)


def test_disabled_poisoning_is_a_no_op():
    with poisoned(False) as mode:
        t = torch.zeros(3)
    assert mode is None and torch.equal(t, torch.zeros(3))


# The suite catches an experts kernel that reads memory it never wrote --------------------------
class _UnclearedRunner(ReferenceExpertsRunner):
    """Writes the reference's result into a fresh buffer "cleared" by multiplying it by zero:
    right for any finite leftovers, wrong for the NaN or Inf that `torch.empty` may hold."""

    def apply(self, inp):
        ref = super().apply(inp)
        return StandardOutput(torch.empty_like(ref.hidden).mul_(0).add_(ref.hidden))


class _Uncleared(ReferenceExperts):
    """Token-major reference experts; `buggy`: their runner is `_UnclearedRunner`."""

    name, priority = "uncleared", 40

    def __init__(self, buggy: bool) -> None:
        self.buggy = buggy

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "standard" and not f.is_quantized]

    def build(self, req, fmt):
        return _UnclearedRunner(req, fmt) if self.buggy else super().build(req, fmt)


def _numeric_results(buggy: bool, poison: bool) -> list:
    name = "uncleared" if buggy else "cleared"
    suite = throwaway_suite(name, [_Uncleared(buggy)], poison=poison)
    cases = [c for c in suite.cases() if c.family == "matrix" and c.quant.name == "bf16" and c.pipeline is not None]
    assert cases and all(c.pipeline.main.name == "uncleared" for c in cases)
    suite.run(cases)
    return suite.results


def test_a_kernel_reading_an_uncleared_buffer_fails_every_case():
    results = _numeric_results(buggy=True, poison=True)
    assert {r.status for r in results} == {"fail"}
    assert all("NaN" in r.detail for r in results), [r.detail for r in results]


def test_a_kernel_that_writes_what_it_reads_passes_with_poison():
    results = _numeric_results(buggy=False, poison=True)
    assert {r.status for r in results} == {"pass"}, [r.detail for r in results if r.status != "pass"]


def test_the_suite_counts_what_it_poisoned():
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    for poison in (True, False):
        suite = Suite("reference", reg, torch.device("cpu"), profile="quick", poison=poison)
        suite.run([c for c in suite.cases() if c.family == "matrix"][:3])
        assert [r.status for r in suite.results] == ["pass"] * 3
        assert (suite.metadata()["poisoned_allocations"] > 0) is poison


def test_the_report_says_whether_allocations_were_poisoned():
    from moehal_conformance import report

    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    on, off = Suite("reference", reg, torch.device("cpu")), Suite("reference", reg, torch.device("cpu"), poison=False)
    assert report.to_dict(on)["poison"] is True and report.to_dict(off)["poison"] is False
    assert "| fresh allocations | poisoned: NaN in floats, 1 in integers (0 allocations) |" in report.to_markdown(on)
    assert "| fresh allocations | not poisoned |" in report.to_markdown(off)


def test_the_cli_poisons_unless_told_not_to():
    from moehal_conformance.cli import build_parser

    assert build_parser().parse_args(["--backend", "reference"]).poison is True
    assert build_parser().parse_args(["--backend", "reference", "--no-poison"]).poison is False


def test_the_suite_hands_its_poison_switch_to_the_ranks(monkeypatch):
    from moehal import distributed_check as dc

    seen = []

    def fake_spawned(world, fn, args, timeout_s):
        seen.append(args)
        return [dc.RankOutcome(0, "ok", [])]

    monkeypatch.setattr(dc, "run_spawned", fake_spawned)
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    for poison in (True, False):
        Suite("reference", reg, torch.device("cpu"), poison=poison).run_ep(2, required=False)
    assert [a[5] for a in seen] == [True, False]  # run_ep_cases' `poison` (tests/distributed: it bites)
    assert all(a[6] is reg.settings for a in seen)  # and the suite's settings (not os.environ)


def test_poisoning_needs_no_fp4_dtype(monkeypatch):
    """torch < 2.8 has no `float4_e2m1fn_x2` (moehal supports torch >= 2.6): every other dtype
    is poisoned as before."""
    import moehal.poison

    monkeypatch.setattr(moehal.poison, "_FP4", None)
    assert _is_poisoned(poison_(torch.zeros(4, dtype=torch.bfloat16)))
    assert _is_poisoned(poison_(torch.zeros(4, dtype=torch.uint8)))
    assert _is_poisoned(poison_(torch.zeros(4, dtype=torch.uint8).view(torch.float8_e4m3fn)))
