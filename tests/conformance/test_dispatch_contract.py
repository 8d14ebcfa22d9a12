"""The padding check holds a dispatcher to its half of the grouped formats' contract (session 45's
mutation audit found these unchecked): padding rows of the dispatched input hold zeros, a masked
layout's `masked_m` counts each local expert's slots, and `max_total_rows` bounds their sum."""

from __future__ import annotations

import dataclasses

import torch
from moehal.formats import ContiguousInput, MaskedInput
from moehal.reference.dispatcher import LocalDispatchRunner, ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts
from throwaway_plugin import throwaway_suite


class _Aligned(ReferenceExperts):
    """The reference experts on contiguous segments aligned to 8 rows (so padding rows exist)."""

    name, priority = "aligned", 40

    def input_formats(self, req):
        formats = super().input_formats(req)
        return [dataclasses.replace(f, row_alignment=8) if f.layout_name == "contiguous" else f for f in formats]


def _dispatcher(change):
    """The reference dispatcher, its dispatched input edited by `change(inp) -> inp`."""

    class _Runner(LocalDispatchRunner):
        def dispatch(self, hidden, topk):
            inp, handle = super().dispatch(hidden, topk)
            return change(inp), handle

    class _Dispatcher(ReferenceDispatcher):
        name, priority = "edited", 40

        def build(self, req, fmt):
            return _Runner(req, fmt)

    return _Dispatcher()


def _padding_results(name, dispatcher=None):
    suite = throwaway_suite(name, [_Aligned()], [dispatcher] if dispatcher is not None else [])
    suite.run([c for c in suite.cases() if c.check == "padding"])
    assert {r.layout for r in suite.results} == {"masked", "contiguous"}
    return {r.layout: r for r in suite.results}


def _dirty_padding(inp):
    if isinstance(inp, ContiguousInput):
        pad = ~inp.live_rows()
    elif isinstance(inp, MaskedInput):
        pad = torch.arange(inp.hidden.shape[1])[None, :] >= inp.masked_m[:, None]
    else:
        return inp
    hidden = inp.hidden.clone()
    hidden[pad] = 1.0
    return dataclasses.replace(inp, hidden=hidden)


def test_the_reference_dispatcher_keeps_the_contract():
    assert {r.status for r in _padding_results("aligned").values()} == {"pass"}


def test_dirty_padding_rows_in_the_dispatched_input_fail():
    """Experts that mask by row_expert or masked_m hide such rows; others would compute them."""
    results = _padding_results("dirty", _dispatcher(_dirty_padding))
    for layout in ("masked", "contiguous"):
        assert results[layout].status == "fail", (layout, results[layout].detail)
        assert "the dispatched input's padding rows are not zero" in results[layout].detail


def test_masked_m_must_count_each_local_experts_slots():
    def one_more(inp):
        if not isinstance(inp, MaskedInput):
            return inp
        return dataclasses.replace(inp, masked_m=inp.masked_m + (torch.arange(inp.masked_m.numel()) == 0).int())

    r = _padding_results("countsoff", _dispatcher(one_more))["masked"]
    assert r.status == "fail" and r.detail.startswith("masked_m is ["), r.detail


def test_max_total_rows_must_bound_the_rows_dispatched():
    def too_small(inp):
        return dataclasses.replace(inp, max_total_rows=1) if isinstance(inp, MaskedInput) else inp

    r = _padding_results("boundoff", _dispatcher(too_small))["masked"]
    assert r.status == "fail" and "max_total_rows 1 is under the" in r.detail, r.detail


def test_experts_leaking_a_small_value_into_padding_rows_fail():
    """Any non-zero value in a padding row of the experts' output fails, however small (the
    audit's mutant let leaks up to 1.0 pass; the existing negative control leaked 7.0)."""
    from moehal.formats import MaskedOutput
    from moehal.reference.experts import ReferenceExpertsRunner

    class _LeakyRunner(ReferenceExpertsRunner):
        def apply(self, inp):
            out = super().apply(inp)
            if isinstance(out, MaskedOutput):
                pad = torch.arange(out.hidden.shape[1])[None, :] >= inp.masked_m[:, None]
                hidden = out.hidden.clone()
                hidden[pad] = 0.5
                return MaskedOutput(hidden)
            return out

    class _Leaky(_Aligned):
        name = "leaky"

        def build(self, req, fmt):
            return _LeakyRunner(req, fmt)

    suite = throwaway_suite("leaky", [_Leaky()])
    suite.run([c for c in suite.cases() if c.check == "padding" and c.layout == "masked"])
    assert suite.results and {r.status for r in suite.results} == {"fail"}
    assert all("padding rows are not zero (max |value| 0.5)" in r.detail for r in suite.results)


def test_the_pairs_family_checks_the_contract_at_top_k_above_one():
    """The padding cases run top-1, where T and T * K agree: a dispatcher bounding a masked
    batch by its tokens instead of its rows shows in the pairings, which run top-2."""

    def tokens_only(inp):
        if not isinstance(inp, MaskedInput) or inp.max_total_rows is None:
            return inp
        return dataclasses.replace(inp, max_total_rows=inp.max_total_rows // 2)

    suite = throwaway_suite("rowsoff", [_Aligned()], [_dispatcher(tokens_only)])
    pairs = [c for c in suite.cases() if c.family == "pairs" and c.pipeline is not None]
    assert pairs and all(c.check == "dispatch" and c.config.top_k == 2 for c in pairs)
    suite.run(pairs)
    by = {(r.pipeline.split(" -> ")[0], r.layout): r for r in suite.results}
    assert by["rowsoff.edited", "masked"].status == "fail", by
    assert "max_total_rows 9 is under the 18 rows dispatched" in by["rowsoff.edited", "masked"].detail
    assert by["reference.local", "masked"].status == "pass"
