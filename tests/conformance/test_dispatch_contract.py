"""The padding check holds a dispatcher to its half of the grouped formats' contract (session 45's
mutation audit found these unchecked): padding rows of the dispatched input hold zeros, a masked
layout's `masked_m` counts each local expert's slots, and `max_total_rows` bounds their sum."""

from __future__ import annotations

import dataclasses
import types

import moehal
import torch
from moehal.formats import ContiguousInput, MaskedInput
from moehal.reference.dispatcher import LocalDispatchRunner, ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts
from moehal_conformance.suite import Suite


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
    plugin = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: moehal.BackendInfo(name, "9.9", "throwaway")),
        moehal_experts=moehal.hookimpl(lambda: [_Aligned()]),
    )
    if dispatcher is not None:
        plugin.moehal_dispatchers = moehal.hookimpl(lambda: [dispatcher])
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    assert reg.register(plugin, name).status == "loaded"
    suite = Suite(name, reg, torch.device("cpu"), profile="quick")
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
