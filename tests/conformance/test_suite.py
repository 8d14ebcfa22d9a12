"""The conformance suite catches wrong numbers, reports declines honestly, and the
reference passes it with readable reports."""

from __future__ import annotations

import dataclasses
import json
import types

import moehal
import pytest
import torch
from moehal.formats import (
    ContiguousInput,
    MaskedInput,
    MaskedOutput,
    StandardInput,
    StandardOutput,
    with_dirty_padding,
)
from moehal.interfaces import BackendInfo, FusedForward, FusedRunner
from moehal.reference.dispatcher import LocalDispatchRunner, ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner
from moehal.reference.oracle import reference_layer
from moehal_conformance import components, report
from moehal_conformance.cli import main as conformance_main
from moehal_conformance.runner import CaseResult
from moehal_conformance.suite import Suite


class _WrongForGeluRunner(ReferenceExpertsRunner):
    def apply(self, inp):
        out = super().apply(inp)
        if self.config.activation is moehal.Activation.GELU:  # a subtle bug in one claimed case
            return type(out)(out.hidden * 1.05)
        return out


def _bf16_experts(name, runner_cls):
    """The reference experts under `name`, bf16 only, running `runner_cls`."""

    class _Experts(ReferenceExperts):
        priority = 40
        quant_schemes = frozenset({moehal.QuantScheme.parse("bf16")})

        def build(self, req, fmt):
            return runner_cls(req, fmt)

    _Experts.name = name
    return _Experts()


class _WrongIntoOutRunner(ReferenceExpertsRunner):
    """Right on a plain call; on an `out=` call its rows are off by one."""

    def apply_into(self, inp, out):
        return dataclasses.replace(self.apply(inp), hidden=self.apply(inp).hidden + 1)


class _DenseReadingRunner(ReferenceExpertsRunner):
    """Reads token-major input as if it were dense (row stride H), whatever its strides: right
    for contiguous inputs, wrong rows for a view of wider rows."""

    def apply(self, inp):
        if isinstance(inp, StandardInput):
            h = inp.hidden
            inp = dataclasses.replace(inp, hidden=torch.as_strided(h, h.shape, (h.shape[1], 1)))
        return super().apply(inp)


class _AlignedLoadsRunner(ReferenceExpertsRunner):
    """Moves token-major rows in 16-byte vectors, as DeepEP and AITER do: a start past an
    aligned address reads the wrong bytes (here: the row shifted to the aligned address)."""

    def apply(self, inp):
        if isinstance(inp, StandardInput):
            h = inp.hidden.contiguous()
            off = h.data_ptr() % 16 // h.element_size()
            if off:
                flat = torch.as_strided(h, (h.numel(),), (1,))
                shifted = torch.as_strided(flat, h.shape, (h.shape[1], 1), h.storage_offset() - off)
                inp = dataclasses.replace(inp, hidden=shifted)
        return super().apply(inp)


class _ClaimsNothing(ReferenceExperts):
    name = "picky"
    priority = 40
    devices = frozenset({"npu"})


class _WholeSegmentsRunner(LocalDispatchRunner):
    """Marks every row of an expert's aligned segment with the expert, padding rows too: the
    numbers stay right, but `row_expert` no longer says which rows hold a token."""

    def dispatch(self, hidden, topk):
        inp, handle = super().dispatch(hidden, topk)
        if isinstance(inp, ContiguousInput):
            r = torch.arange(inp.hidden.shape[0])[:, None]
            a = self.fmt.row_alignment
            ends = inp.segment_start.long() + (inp.counts.long() + a - 1) // a * a  # the segments' aligned ends
            seg = (r >= ends[None, :]).sum(1)
            whole = torch.where(seg < ends.numel(), seg, -1).to(torch.int32)
            inp = dataclasses.replace(inp, row_expert=whole)
        return inp, handle


class _WholeSegments(ReferenceDispatcher):
    name = "segments"
    priority = 40

    def build(self, req, fmt):
        return _WholeSegmentsRunner(req, fmt)


def _plugin(name, experts, dispatcher=None):
    ns = types.SimpleNamespace()
    ns.moehal_backend_info = moehal.hookimpl(lambda: BackendInfo(name, "9.9", "throwaway"))
    ns.moehal_experts = moehal.hookimpl(lambda: experts if isinstance(experts, list) else [experts])
    if dispatcher is not None:
        ns.moehal_dispatchers = moehal.hookimpl(lambda: [dispatcher])
    return ns


def _reference_results(check, device="cpu"):
    """The reference backend's results for one check of the quick profile."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    suite = Suite("reference", reg, torch.device(device), profile="quick")
    suite.run([c for c in suite.cases() if c.check == check])
    assert suite.results, check
    return suite.results


def _suite(name, experts, dispatcher=None, device="cpu"):
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    assert reg.register(_plugin(name, experts, dispatcher), name).status == "loaded"
    return Suite(name, reg, torch.device(device), profile="quick")


def test_wrong_numbers_in_one_claimed_case_fail_the_suite():
    suite = _suite("buggy", _bf16_experts("buggy", _WrongForGeluRunner))
    suite.run([c for c in suite.cases() if c.family == "matrix"])
    failed = {r.id for r in suite.results if r.status == "fail"}
    assert failed and all("/gelu/" in f for f in failed), failed
    assert any(r.status == "pass" and "/silu/" in r.id for r in suite.results)
    assert not suite.ok
    assert "**Verdict: FAIL**" in report.to_markdown(suite)


def test_experts_wrong_only_into_out_fail_the_out_buffer_check():
    suite = _suite("wrongout", _bf16_experts("wrongout", _WrongIntoOutRunner))
    suite.run([c for c in suite.cases() if c.check in ("out_buffer", "numeric")])
    failed = [r for r in suite.results if r.status == "fail"]
    assert failed and all(r.check == "out_buffer" for r in failed), [r.id for r in failed]
    assert all("differs from the call without out" in r.detail for r in failed)
    assert any(r.status == "pass" and r.check == "numeric" for r in suite.results)
    assert not suite.ok


def test_experts_that_read_inputs_as_dense_fail_the_strided_inputs_check():
    suite = _suite("dense", _bf16_experts("dense", _DenseReadingRunner))
    suite.run([c for c in suite.cases() if c.check in ("strided_inputs", "numeric")])
    failed = [r for r in suite.results if r.status == "fail"]
    # token-major experts get the caller's view; grouped layouts get the dispatcher's own buffers
    assert failed and all(r.check == "strided_inputs" and r.layout == "standard" for r in failed), [
        (r.id, r.detail) for r in failed
    ]
    passed = {(r.check, r.layout) for r in suite.results if r.status == "pass"}
    assert {("numeric", "standard"), ("strided_inputs", "contiguous")} <= passed, passed
    assert not suite.ok


def test_experts_that_load_aligned_vectors_fail_the_strided_inputs_check():
    """A contiguous input one element past an aligned address: `.contiguous()` keeps it, and a
    kernel that assumes 16-byte aligned rows reads the wrong bytes (a memory-layout review)."""
    suite = _suite("vectors", _bf16_experts("vectors", _AlignedLoadsRunner))
    suite.run([c for c in suite.cases() if c.check in ("strided_inputs", "numeric")])
    failed = [r for r in suite.results if r.status == "fail"]
    assert failed and all(r.check == "strided_inputs" and r.layout == "standard" for r in failed), [
        (r.id, r.detail) for r in failed
    ]
    assert all("one element past an aligned address" in r.detail for r in failed), [r.detail for r in failed]
    assert any(r.status == "pass" and r.check == "numeric" and r.layout == "standard" for r in suite.results)


def test_the_reference_passes_the_strided_inputs_check():
    results = _reference_results("strided_inputs")
    assert {r.layout for r in results} == {"standard", "contiguous", "masked"}
    assert all(r.status == "pass" and r.detail.startswith("strided inputs: ") for r in results), [
        (r.id, r.detail) for r in results
    ]


class _Int32IdsRunner(ReferenceExpertsRunner):
    """Reads token-major ids as int32 whatever their dtype: right for int32 ids, and for int64
    ids it reinterprets their bytes (low and high words as two ids), as a kernel handed a
    pointer would."""

    def apply(self, inp):
        if isinstance(inp, StandardInput) and inp.topk_ids.dtype == torch.int64:
            t, k = inp.topk_ids.shape
            inp = dataclasses.replace(
                inp, topk_ids=inp.topk_ids.contiguous().view(torch.int32).view(-1)[: t * k].view(t, k)
            )
        return super().apply(inp)


class _PassIdsDispatcher(ReferenceDispatcher):
    """The reference dispatcher, but token-major ids go to the experts in the caller's dtype."""

    name = "passids"
    priority = 40

    def build(self, req, fmt):
        runner = super().build(req, fmt)
        local = runner.dispatch

        def dispatch(hidden, topk):
            inp, handle = local(hidden, topk)
            if isinstance(inp, StandardInput):
                inp = dataclasses.replace(inp, topk_ids=inp.topk_ids.to(topk.ids.dtype))
            return inp, handle

        runner.dispatch = dispatch
        return runner


def test_experts_that_take_int64_ids_as_int32_fail_the_input_dtypes_check():
    suite = _suite("int32ids", _bf16_experts("int32ids", _Int32IdsRunner), _PassIdsDispatcher())
    suite.run([c for c in suite.cases() if c.check in ("input_dtypes", "numeric")])
    failed = [r for r in suite.results if r.status == "fail"]
    assert failed and all(r.check == "input_dtypes" and r.layout == "standard" for r in failed), [
        (r.id, r.detail) for r in failed
    ]
    assert any(r.status == "pass" and r.check == "numeric" and r.layout == "standard" for r in suite.results)
    assert not suite.ok


class _WrapsIdsDispatcher(ReferenceDispatcher):
    """Declares dropping -1 ids, but indexes experts modulo their count, as a kernel that
    indexes with a negative id may: a -1 slot lands on the last expert."""

    name = "wrapping"
    priority = 40
    drops_padding_ids = True

    def build(self, req, fmt):
        runner = super().build(req, fmt)
        local, n = runner.dispatch, req.config.num_experts

        def dispatch(hidden, topk):
            return local(hidden, moehal.TopK(topk.ids % n, topk.weights))

        runner.dispatch = dispatch
        return runner


def test_a_dispatcher_that_claims_padding_ids_but_wraps_them_fails_the_padded_ids_check():
    suite = _suite("wrapids", _bf16_experts("wrapids", ReferenceExpertsRunner), _WrapsIdsDispatcher())
    suite.run([c for c in suite.cases() if c.check in ("padded_ids", "numeric") and c.family != "matrix"])
    by_check = {}
    for r in suite.results:
        by_check.setdefault(r.check, set()).add(r.status)
    seen = [(r.id, r.status, r.detail) for r in suite.results]
    assert by_check == {"padded_ids": {"fail"}, "numeric": {"pass"}}, seen
    assert all("padded tokens' rows are not zero" in r.detail for r in suite.results if r.check == "padded_ids")
    assert not suite.ok


def test_the_reference_passes_the_padded_ids_check():
    results = _reference_results("padded_ids")
    assert {r.layout for r in results} == {"standard", "contiguous", "masked"}
    assert all(r.status == "pass" and "padded rows zero" in r.detail for r in results), [
        (r.id, r.detail) for r in results
    ]


def test_the_reference_passes_the_input_dtypes_check():
    results = _reference_results("input_dtypes")
    assert {r.layout for r in results} == {"standard", "contiguous", "masked"}
    assert all(r.status == "pass" and "int64 ids, bfloat16 weights" in r.detail for r in results), [
        (r.id, r.detail) for r in results
    ]


class _DefaultStreamRunner(ReferenceExpertsRunner):
    """Computes on the caller's stream, where a slow last step (a sleep) writes a buffer it keeps
    per shape, then hands out a copy of that buffer made on the default stream (a wrapper that
    launches its last kernel on a stream it cached). On the default stream all of it is in
    order. Off it, the copy runs while the caller's stream sleeps, and returns the previous
    call's result. The sleep makes that certain: the reference synchronizes with the host on
    its grouped layouts, and without it the write had won the race there (session 35, calls 1
    and 2). Elementwise on purpose: computing the whole experts off the caller's stream read
    the dispatcher's indices before they were written, and an index out of range is a
    device-side assert, which ends the process's CUDA context (session 34, call 8)."""

    def apply(self, inp):
        out = super().apply(inp)
        kept = self.__dict__.setdefault("kept", {})
        buf = kept.setdefault(tuple(out.hidden.shape), torch.empty_like(out.hidden))
        torch.cuda._sleep(20_000_000)  # ~10-15 ms at GPU clocks
        buf.copy_(out.hidden)
        with torch.cuda.stream(torch.cuda.default_stream()):
            hidden = buf.clone()
        return dataclasses.replace(out, hidden=hidden)


def test_side_stream_is_not_run_without_cuda():
    suite = _suite("plain", _bf16_experts("plain", ReferenceExpertsRunner))
    suite.run([c for c in suite.cases() if c.check == "side_stream"])
    assert suite.results and all(r.status == "not run" and "CUDA streams" in r.detail for r in suite.results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_experts_off_the_callers_stream_fail_the_side_stream_check():
    suite = _suite("wrongstream", _bf16_experts("wrongstream", _DefaultStreamRunner), device="cuda")
    suite.run([c for c in suite.cases() if c.check in ("side_stream", "numeric") and c.family != "matrix"])
    by_check = {}
    for r in suite.results:
        by_check.setdefault(r.check, set()).add(r.status)
    wrong = [(r.id, r.status, r.detail) for r in suite.results if (r.status == "pass") != (r.check == "numeric")]
    assert by_check["side_stream"] == {"fail"} and by_check["numeric"] == {"pass"}, wrong
    good = _reference_results("side_stream", "cuda")
    assert all(r.status == "pass" for r in good), [(r.id, r.detail) for r in good]


class _SharedBufferRunner(ReferenceExpertsRunner):
    """Keeps one output buffer per shape for the whole process, as moehal's CUDA scratch is
    kept, shared by every layer of that shape: it writes its result there, sleeps, and hands out
    a copy. Two layers whose forwards overlap on two streams write the buffer one after the
    other before either copies it out, unless something orders their forwards."""

    shared: dict[tuple[int, ...], torch.Tensor] = {}

    def apply(self, inp):
        out = super().apply(inp)
        buf = self.shared.setdefault(tuple(out.hidden.shape), torch.empty_like(out.hidden))
        buf.copy_(out.hidden)
        torch.cuda._sleep(20_000_000)  # ~10-15 ms at GPU clocks
        return dataclasses.replace(out, hidden=buf.clone())


def test_two_streams_is_not_run_without_cuda():
    suite = _suite("plain", _bf16_experts("plain", ReferenceExpertsRunner))
    suite.run([c for c in suite.cases() if c.check == "two_streams"])
    assert suite.results and all(r.status == "not run" and "CUDA streams" in r.detail for r in suite.results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_buffers_fail_the_two_streams_check_unless_forwards_are_ordered(monkeypatch):
    from moehal import stream_order

    good = _reference_results("two_streams", "cuda")  # (its dispatcher may be cuda.permute's)
    assert all(r.status == "pass" for r in good), [(r.id, r.detail) for r in good]
    suite = _suite("shared", _bf16_experts("shared", _SharedBufferRunner), device="cuda")
    cases = [c for c in suite.cases() if c.check == "two_streams"]
    suite.run(cases)  # ordered (the default): the buffer is written and read one forward at a time
    ordered = [(r.id, r.status, r.detail) for r in suite.results]
    assert ordered and all(status == "pass" for _, status, _ in ordered), ordered
    monkeypatch.setattr(stream_order, "ENABLED", False)
    unordered = _suite("shared", _bf16_experts("shared", _SharedBufferRunner), device="cuda")
    unordered.run([c for c in unordered.cases() if c.check == "two_streams"])
    seen = [(r.id, r.status, r.detail) for r in unordered.results]
    assert seen and all(status == "fail" and "differs from its default-stream forward" in detail
                        for _, status, detail in seen), seen  # fmt: skip


class _KeepsBuffersRunner(ReferenceExpertsRunner):
    """Keeps one output buffer per shape across calls and writes it in place, allocated where
    the first call runs (an inference tensor under `torch.inference_mode()`)."""

    def apply(self, inp):
        out = super().apply(inp)
        kept = self.__dict__.setdefault("kept", {})
        buf = kept.setdefault(tuple(out.hidden.shape), torch.empty_like(out.hidden))
        buf.copy_(out.hidden)
        return dataclasses.replace(out, hidden=buf.clone())


def test_buffers_kept_from_inference_mode_fail_the_inference_mode_check():
    suite = _suite("keeps", _bf16_experts("keeps", _KeepsBuffersRunner))
    suite.run([c for c in suite.cases() if c.check in ("inference_mode", "numeric")])
    failed = [r for r in suite.results if r.status == "fail"]
    assert failed and all(r.check == "inference_mode" for r in failed), [(r.id, r.detail) for r in failed]
    assert all("Inplace update to inference tensor" in r.detail for r in failed)
    assert any(r.status == "pass" and r.check == "numeric" for r in suite.results)
    good = _reference_results("inference_mode")
    assert all(r.status == "pass" for r in good), [(r.id, r.detail) for r in good]


def test_a_contiguous_dispatcher_marking_padding_rows_fails_the_padding_check():
    class _Experts(ReferenceExperts):  # the reference's, on segments aligned to 8 rows
        name = "aligned"
        priority = 40

        def input_formats(self, req):
            formats = super().input_formats(req)
            return [dataclasses.replace(f, row_alignment=8) if f.layout_name == "contiguous" else f for f in formats]

    def padding_statuses(suite):
        suite.run([c for c in suite.cases() if c.check == "padding"])
        by_layout = {}
        for r in suite.results:
            by_layout.setdefault(r.layout, set()).add(r.status)
        return by_layout

    # the reference dispatcher marks padding rows -1: the aligned segments pass
    assert padding_statuses(_suite("aligned", _Experts())) == {"contiguous": {"pass"}, "masked": {"pass"}}
    suite = _suite("segments", _Experts(), _WholeSegments())
    assert padding_statuses(suite) == {"contiguous": {"fail"}, "masked": {"pass"}}
    assert all("row_expert marks" in r.detail for r in suite.results if r.layout == "contiguous")


class _TokenMajorExperts(ReferenceExperts):
    """Token-major experts that claim any shape (as `cuda.triton`)."""

    name = "tokens"
    priority = 40

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "standard"]


class _KMultipleOf128Experts(ReferenceExperts):
    """Grouped-layout experts that decline the base shape's intermediate size of 64 (as
    DeepGEMM's FP8 GEMMs, which want K in multiples of 128)."""

    name = "k128"
    priority = 30

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name != "standard"]

    def check_shape(self, req):
        from moehal.capability import accept, decline

        if req.config.intermediate_size % 128:
            return decline(f"intermediate_size={req.config.intermediate_size} is not a multiple of 128", "shape")
        return accept(predicate="shape")


def test_experts_declining_the_base_shape_get_padding_cases_at_the_wide_one():
    """As on `cuda`: token-major experts claim the base shape, while the grouped-layout experts
    decline it."""
    suite = _suite("k128", [_TokenMajorExperts(), _KMultipleOf128Experts()])
    padding = [c for c in suite.cases() if c.check == "padding" and c.pipeline is not None]
    assert padding and all("/bias_rows_512/" in c.id for c in padding), [c.id for c in padding]
    assert {c.config.intermediate_size for c in padding} == {512}
    suite.run(padding)
    assert {r.status for r in suite.results} == {"pass"}


def test_behaviour_checks_run_per_claimed_scheme_and_reach_experts_declining_the_base_shape():
    """As `cuda`'s DeepGEMM FP8 experts, which decline the base shape: the behaviour checks
    (graphs, streams, buffers) reach them at the 512-wide shape, once per claimed quant scheme,
    and the token-major path the base shape reached is not repeated there."""
    from moehal_conformance.cases import BEHAVIOUR_CHECKS

    suite = _suite("k128b", [_TokenMajorExperts(), _KMultipleOf128Experts()])
    cases = suite.cases()
    claimed = {c.quant for c in cases if c.family == "matrix" and c.pipeline is not None}
    assert len(claimed) > 1, claimed
    for check in BEHAVIOUR_CHECKS:
        mine = [c for c in cases if c.check == check]
        for quant in claimed:
            paths = {(c.pipeline.main.name, c.layout, c.config.intermediate_size) for c in mine if c.quant == quant}
            want = {("tokens", "standard", 64), ("k128", "masked", 512), ("k128", "contiguous", 512)}
            if check == "strided_inputs":  # also at a hidden size with a K tail (session 45)
                want.add(("tokens", "standard", 96))
            assert paths == want, (check, quant, paths)
    determinism = [c for c in cases if c.check == "determinism"]
    suite.run(determinism)
    assert {r.status for r in suite.results} == {"pass"}


def test_padding_cases_check_the_main_format_when_a_small_format_takes_their_batch():
    """As `cuda`'s fp8_tensor layers at the wide shape: token-major input up to 128 tokens, so
    the padding case's 5 tokens would go token-major, which has no padding rows to check."""
    from moehal.formats import ActivationFormat, Layout, SmallBatchFormat

    class _SmallToo(ReferenceExperts):
        name = "smalltoo"
        priority = 40

        def input_formats(self, req):
            return [f for f in super().input_formats(req) if f.layout_name in ("masked", "contiguous")]

        def small_batch_format(self, req):
            return SmallBatchFormat(ActivationFormat(Layout.STANDARD, req.config.dtype), 128, "test")

    suite = _suite("smalltoo", _SmallToo())
    padding = [c for c in suite.cases() if c.check == "padding" and c.pipeline is not None]
    with_small = [c for c in padding if c.pipeline.small is not None]
    assert with_small and all(c.config.top_k == 1 for c in padding)
    suite.run(padding)
    assert {r.status for r in suite.results} == {"pass"}, [(r.id, r.detail) for r in suite.results]
    assert all(r.detail.startswith("padding rows zero") for r in suite.results)


def test_a_backend_claiming_nothing_gets_declines_with_reasons():
    suite = _suite("picky", _ClaimsNothing())
    suite.run()
    statuses = {r.status for r in suite.results if r.family != "honesty"}
    assert statuses == {"declined"}
    assert all("runs on ['npu'], not cpu" in r.detail for r in suite.results if r.family == "matrix")
    assert not suite.claimed_anything and not suite.ok
    assert "NOTHING CLAIMED" in report.to_markdown(suite)


def test_reference_passes_and_reports_are_readable(tmp_path, capsys):
    # On the CPU wherever the tests run: on a GPU host the reference would take the GPU, and run
    # the CUDA graph cases this test expects to be "not run" (session 35, call 2).
    code = conformance_main(["--backend", "reference", "--device", "cpu", "--quick", "--report", str(tmp_path / "ref")])
    assert code == 0, capsys.readouterr().out
    data = json.loads((tmp_path / "ref.json").read_text())
    assert data["summary"]["fail"] == 0 and data["summary"]["ok"] is True and data["backend"] == "reference"
    assert data["hardware"]["kind"] == "cpu" and data["date"]
    statuses = {c["status"] for c in data["cases"]}
    assert statuses <= {"pass", "not run"}
    graph = [c for c in data["cases"] if c["family"] == "cuda_graph"]
    assert graph and all(c["status"] == "not run" and "CUDA" in c["detail"] for c in graph)
    md = (tmp_path / "ref.md").read_text()
    assert "**Verdict: PASS**" in md and "| bf16 |" in md


def test_best_backend_on_a_bare_cpu_is_the_reference():
    # Emulated or interpreted paths (NPU emulation, TRITON_INTERPRET=1) never count as best.
    assert Suite.create("best", "cpu").backend == "reference"


class _FaultsOnGeluRunner(ReferenceExpertsRunner):
    def apply(self, inp):
        if self.config.activation is moehal.Activation.GELU:
            raise RuntimeError("CUDA error: an illegal instruction was encountered")
        return super().apply(inp)


def test_a_lost_device_context_stops_the_run_and_names_the_case(monkeypatch, tmp_path):
    """After a kernel fault every call in the process raises the same error: the cases after
    it must say they did not run, not fail for a reason that is not theirs (session 33: one
    fault on an H200 turned into 100 failed cases)."""
    import moehal_conformance.suite as suite_mod

    lost = []
    monkeypatch.setattr(suite_mod, "context_lost", lambda device: "AcceleratorError: context gone" if lost else None)
    suite = _suite("faulty", _bf16_experts("faulty", _FaultsOnGeluRunner))
    cases = [c for c in suite.cases() if c.family == "matrix"]
    first_gelu = next(n for n, c in enumerate(cases) if "/gelu/" in c.id)
    lost.append(True)  # from now on the probe reports the context gone; only a failure asks it
    suite.run(cases)
    assert [r.status for r in suite.results[:first_gelu]] == ["pass"] * first_gelu
    failed = suite.results[first_gelu]
    assert failed.status == "fail" and "illegal instruction" in failed.detail
    assert "RuntimeError" in failed.traceback and "_FaultsOnGeluRunner" not in failed.detail
    rest = suite.results[first_gelu + 1 :]
    assert len(suite.results) == len(cases) and rest
    assert all(r.status == "not run" and r.detail == f"the device's context was lost in {failed.id}" for r in rest)
    assert suite.lost_in == failed.id and not suite.ok
    js, md = report.write(suite, tmp_path / "faulty")
    data = json.loads(js.read_text())
    assert data["lost_context"] == {"case": failed.id, "error": "AcceleratorError: context gone"}
    assert "illegal instruction" in data["cases"][first_gelu]["traceback"]
    assert all("traceback" not in c for c in data["cases"][:first_gelu])  # passing cases carry none
    text = md.read_text()
    assert "**Verdict: FAIL**" in text and f"**The device's context was lost** in `{failed.id}`" in text


def test_a_failure_that_leaves_the_device_usable_does_not_stop_the_run(tmp_path):
    # on the CPU, context_lost is never the cause
    suite = _suite("faulty", _bf16_experts("faulty", _FaultsOnGeluRunner))
    cases = [c for c in suite.cases() if c.family == "matrix"]
    suite.run(cases)
    assert len(suite.results) == len(cases) and "not run" not in {r.status for r in suite.results}
    failed = {r.id for r in suite.results if r.status == "fail"}
    assert failed == {c.id for c in cases if "/gelu/" in c.id} and not suite.lost_in
    assert "context was lost" not in report.to_markdown(suite)


# The components section: what the run did with each declared component ------------------------
def test_components_of_a_buggy_backend_say_fail_and_count_its_cases():
    suite = _suite("buggy", _bf16_experts("buggy", _WrongForGeluRunner))
    suite.run([c for c in suite.cases() if c.family == "matrix"])
    (comp,) = components.summarize(suite)  # the plugin declares one experts kernel, no dispatcher
    ran = [r for r in suite.results if "buggy.buggy" in r.pipeline.split()]
    failed = sum(r.status == "fail" for r in ran)
    assert comp.qualname == "buggy.buggy" and comp.kind == "experts" and comp.status == "FAIL"
    assert (comp.passed, comp.failed) == (len(ran) - failed, failed) and failed > 0
    assert comp.detail == f"{failed} of {len(ran)} cases failed"
    assert "| `buggy.buggy` | experts | **FAIL** |" in report.to_markdown(suite)


def test_components_that_never_ran_give_their_own_decline():
    suite = _suite("picky", _ClaimsNothing())
    suite.run([c for c in suite.cases() if c.family == "matrix"])
    (comp,) = components.summarize(suite)
    assert comp.status == "not run" and comp.passed == comp.failed == 0
    assert comp.label == "not run: [hardware] runs on ['npu'], not cpu"


def _reference_suite():
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    return Suite("reference", reg, torch.device("cpu"), profile="quick")


def test_reference_components_in_the_reports(tmp_path):
    suite = _reference_suite()
    suite.run([c for c in suite.cases() if c.family == "matrix"])
    by_name = {c.qualname: c for c in components.summarize(suite)}
    assert list(by_name) == ["reference.torch_distributed", "reference.local", "reference.experts"]
    n = sum(r.status == "pass" for r in suite.results)
    assert by_name["reference.experts"].status == "verified" and by_name["reference.experts"].passed == n > 0
    assert by_name["reference.experts"].detail == f"{n} cases passed"
    ep = by_name["reference.torch_distributed"]
    assert ep.status == "not run" and ep.detail.startswith("[parallel] ep_size is 1")
    assert "--ep WORLD --ep-dispatcher reference.torch_distributed" in ep.detail
    js, md = report.write(suite, tmp_path / "ref")
    data = json.loads(js.read_text())
    assert [c["qualname"] for c in data["components"]] == list(by_name)
    assert data["components"][2]["status"] == "verified"
    text = md.read_text()
    assert text.index("## Components") < text.index("## Matrix")
    assert f"| `reference.experts` | experts | verified | {n} cases passed |" in text


def test_components_that_passed_only_off_hardware_are_not_called_verified():
    suite = _reference_suite()
    pipe = "reference.local -> reference.experts [standard[bfloat16]]"

    def result(i, mode, status="pass"):
        return CaseResult(f"c{i}", "matrix", "numeric", "bf16", "standard", pipe, status, mode)

    suite.results = [result(0, "interpreted"), result(1, "interpreted"), result(2, "emulated")]
    experts = {c.qualname: c for c in components.summarize(suite)}["reference.experts"]
    assert experts.status == "emulated" and experts.detail == "3 cases passed (1 emulated, 2 interpreted)"
    suite.results = [result(0, "interpreted"), result(1, "interpreted", "not run")]
    experts = {c.qualname: c for c in components.summarize(suite)}["reference.experts"]
    assert experts.status == "interpreted" and experts.detail == "1 case passed (1 interpreted); 1 not run"
    suite.results.append(result(2, "native"))
    assert {c.qualname: c for c in components.summarize(suite)}["reference.experts"].status == "verified"


def test_a_component_is_named_by_whole_words_of_the_pipeline():
    pipe = "cuda.permute -> cuda.triton [standard[bfloat16]]"
    r = CaseResult("c", "matrix", "numeric", "bf16", "standard", pipe, "pass")
    assert components.ran_in(r, "cuda.triton") and components.ran_in(r, "cuda.permute")
    assert not components.ran_in(r, "cuda.trit") and not components.ran_in(r, "cuda.triton_weights")
    fused = dataclasses.replace(r, pipeline="fused cuda.trtllm_fp8_block")
    assert components.ran_in(fused, "cuda.trtllm_fp8_block") and not components.ran_in(fused, "cuda.triton")


class _RaisingChecks(ReferenceExperts):
    name = "raising"
    priority = 40

    def check_hardware(self, req):
        raise RuntimeError("probe exploded")


def test_a_check_that_raises_is_named_as_a_plugin_bug_everywhere(capsys):
    from moehal.selection import machine_decision

    suite = _suite("raising", _RaisingChecks())
    # The suite's cases: each fails with the typed error naming the implementation (the run goes
    # on, and the report names each config); a layer's build raises it.
    cases = [c for c in suite.cases() if c.check != "honesty"]
    assert cases and all("raising.raising: a capability check raised RuntimeError" in (c.error or "") for c in cases)
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    with pytest.raises(moehal.PluginCheckError, match="MOEHAL_DISABLE_PLUGINS=raising"):
        moehal.MoELayer(cfg, device="cpu", registry=suite.registry)
    # The report's components and doctor: a line that says so, not a crash.
    (comp,) = components.summarize(suite)
    assert comp.status == "not run"
    assert comp.detail.startswith("raising.raising: a capability check raised RuntimeError: probe exploded")
    d = machine_decision(_RaisingChecks(), moehal.hardware.detect("cpu"))
    assert not d.ok and d.reason == "its capability check raised RuntimeError: probe exploded"


def test_the_cli_reports_a_check_that_raises_as_a_failure(monkeypatch, capsys):
    import moehal_conformance.suite as suite_mod

    registry = _suite("raising", _RaisingChecks()).registry
    monkeypatch.setattr(suite_mod, "make_registry", lambda emulate=frozenset(): registry)
    assert conformance_main(["--backend", "raising", "--device", "cpu", "--quick"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "case(s) failed" in out and "a capability check raised" in out


def test_the_cli_prints_an_unknown_backend_without_markup_tags(capsys):
    # the style renders (no literal tags), and the name, untrusted text, is printed as given
    assert conformance_main(["--backend", "nosuch[/bold]", "--device", "cpu"]) == 2
    out = " ".join(capsys.readouterr().err.split())
    assert "[red]" not in out and "unknown backend 'nosuch[/bold]'" in out


class _RaisingFormats(ReferenceDispatcher):
    name = "negotiator"
    priority = 40

    def can_produce(self, fmt, req):
        raise KeyError(fmt.layout_name)


def test_a_format_negotiation_that_raises_is_named_too():
    suite = _suite("formats", _bf16_experts("formats", ReferenceExpertsRunner), _RaisingFormats())
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    with pytest.raises(moehal.PluginCheckError, match=r"formats\.negotiator: can_produce raised KeyError"):
        moehal.MoELayer(cfg, device="cpu", registry=suite.registry)


# Audit of the suite itself (session 41's findings) ---------------------------------------------
class _NoScalingDispatcher(ReferenceDispatcher):
    """The reference dispatcher, but it forgets `routed_scaling_factor`."""

    name = "unscaled"
    priority = 40

    def build(self, req, fmt):
        runner = super().build(req, fmt)
        runner.scale = 1.0
        return runner


def test_the_oracle_keeps_the_reference_dispatcher_whatever_the_backend_declares():
    """`MoELayer(backend="reference")` forces the reference experts only: a CPU dispatcher of the
    backend under test that outranks `reference.local` sat in the oracle too, and a bug in it was
    checked against itself (the routed_scaling cases passed with the output 2.5x off)."""
    suite = _suite("noscale", _bf16_experts("noscale", ReferenceExpertsRunner), _NoScalingDispatcher())
    cases = [c for c in suite.cases() if c.quant.name == "bf16" and c.pipeline is not None]
    cases = [c for c in cases if "/routed_scaling/" in c.id or c.id.startswith("matrix/bf16/silu/")]
    assert all(c.pipeline.dispatcher.qualname == "noscale.unscaled" for c in cases), [c.id for c in cases]
    suite.run(cases)
    by_feature = {}
    for r in suite.results:
        by_feature.setdefault(r.id.split("/")[2], set()).add(r.status)
    assert by_feature == {"silu": {"pass"}, "routed_scaling": {"fail"}}, [(r.id, r.detail) for r in suite.results]
    assert all(r.metrics["rel_l2"] > 0.5 for r in suite.results if r.status == "fail")


def _cli_report(tmp_path, name, *args):
    argv = ["--backend", "reference", "--device", "cpu", "--quick", "--report", str(tmp_path / name), *args]
    code = conformance_main(argv)
    data = json.loads((tmp_path / f"{name}.json").read_text())
    verdict = next(line for line in (tmp_path / f"{name}.md").read_text().splitlines() if line.startswith("**Verdict"))
    return code, data, verdict


def test_the_cli_and_its_reports_agree_on_a_k_subset(tmp_path, capsys):
    """A -k selection that runs nothing (a typo, or cases that do not run on this device) is no
    pass: exit 1, as the reports say. A passing subset exits 0, and its reports say it was one."""
    code, data, verdict = _cli_report(tmp_path, "none", "-k", "nosuchcase")
    assert code == 1 and data["summary"]["ok"] is False and data["select"] == "nosuchcase"
    assert verdict.startswith("**Verdict: NOTHING RAN, subset (-k `nosuchcase`)**")
    code, data, verdict = _cli_report(tmp_path, "graphs", "-k", "cuda_graph")
    assert data["summary"]["not run"] > 0 and data["summary"]["pass"] == 0
    assert code == 1 and data["summary"]["ok"] is False
    code, data, verdict = _cli_report(tmp_path, "silu", "-k", "matrix/bf16/silu/")
    assert code == 0 and data["summary"]["ok"] is True and data["summary"]["pass"] > 0
    assert data["select"] == "matrix/bf16/silu/"
    assert verdict.startswith("**Verdict: PASS, subset (-k `matrix/bf16/silu/`)**")
    # the JSON says it in the same words: `ok` alone is true for a subset too (a consumer, the
    # docs' Reports page among them, read a subset's `ok` as the backend's PASS)
    assert data["summary"]["subset"] is True
    assert data["summary"]["verdict"] == "PASS, subset (-k `matrix/bf16/silu/`)"
    assert "PASS (subset: -k matrix/bf16/silu/)" in " ".join(capsys.readouterr().out.split())
    code, data, _ = _cli_report(tmp_path, "notsilu", "-k", "not matrix/bf16/silu/")
    ids = [c["id"] for c in data["cases"]]
    assert code == 0 and ids and not any("matrix/bf16/silu/" in i for i in ids)
    assert any("matrix/bf16/gelu/" in i for i in ids)


def _fused_suite(name, fused):
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    ns = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: BackendInfo(name, "9.9", "throwaway")),
        moehal_fused_forwards=moehal.hookimpl(lambda: [fused]),
    )
    assert reg.register(ns, name).status == "loaded"
    return Suite(name, reg, torch.device("cpu"), profile="quick")


class _Float32Runner(FusedRunner):
    """The reference layer, its output handed back in float32 whatever the layer's dtype."""

    def __init__(self, req):
        self.ref = reference_layer(req.config, req.quant, "cpu", layout="standard", validate=False)

    def load(self, weights):
        self.ref.load_weights(weights)

    def forward(self, hidden, topk, router_logits):
        return self.ref(hidden, topk.ids, topk.weights).float()


class _Float32Fused(FusedForward):
    name = "f32"
    priority = 40
    devices = frozenset({"cpu"})
    quant_schemes = frozenset({moehal.QuantScheme.parse("bf16")})

    def build(self, req):
        return _Float32Runner(req)


def test_an_output_in_another_dtype_than_the_layers_fails():
    """compare() looks at values only: a bf16 layer returning float32 (twice the traffic, and an
    engine's bf16 residual add promotes or refuses it) passed on its numbers."""
    suite = _fused_suite("f32", _Float32Fused())
    cases = [c for c in suite.cases() if c.check in ("numeric", "out_buffer") and c.pipeline is not None]
    cases = [c for c in cases if c.config.dtype == torch.bfloat16 and c.family in ("matrix", "out_buffer")]
    assert {c.check for c in cases} == {"numeric", "out_buffer"}
    suite.run(cases)
    seen = [(r.id, r.status, r.detail) for r in suite.results]
    assert all(status == "fail" for _, status, _ in seen), seen
    # the layer itself refuses a fused forward's output of another dtype (a ContractError naming
    # the pipeline), with or without out=
    assert all(d.startswith("ContractError: fused f32.f32 returned") and "torch.float32" in d for _, _, d in seen), seen


class _ContiguousExperts(ReferenceExperts):
    """Contiguous layout only; takes biases."""

    name = "cont"
    priority = 40

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "contiguous"]


class _DirtyPaddingRunner(ReferenceExpertsRunner):
    """Leaves 7.0 in every padding row of its masked output."""

    def apply(self, inp):
        out = super().apply(inp)
        live = torch.arange(out.hidden.shape[1])[None, :] < inp.masked_m[:, None]
        return MaskedOutput(torch.where(live[..., None], out.hidden, torch.full_like(out.hidden, 7.0)))


class _MaskedNoBiasExperts(ReferenceExperts):
    """Masked layout only; no biases; dirty padding rows."""

    name = "mask"
    priority = 30
    supports_bias = False

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "masked"]

    def build(self, req, fmt):
        return _DirtyPaddingRunner(req, fmt)


def test_a_layout_whose_experts_take_no_biases_still_gets_padding_cases():
    """The padding family stopped at the first config that gave any case: the contiguous
    experts took the bias config, and the masked ones (no biases) were never checked."""
    suite = _suite("twolayouts", [_ContiguousExperts(), _MaskedNoBiasExperts()])
    padding = [c for c in suite.cases() if c.check == "padding"]
    claimed = {c.quant.name for c in suite.cases() if c.family == "matrix" and c.pipeline is not None}
    assert {(c.quant.name, c.layout) for c in padding} == {(q, x) for q in claimed for x in ("contiguous", "masked")}
    assert all("/bias_rows/" in c.id for c in padding if c.layout == "contiguous")
    assert all("/plain_rows/" in c.id for c in padding if c.layout == "masked")
    suite.run([c for c in padding if c.quant.name == "bf16"])
    statuses = {r.layout: (r.status, r.detail) for r in suite.results}
    assert statuses["contiguous"][0] == "pass" and statuses["masked"][0] == "fail", statuses
    assert "padding rows are not zero (max |value| 7)" in statuses["masked"][1]


class _DenseIdsAtDecodeRunner(ReferenceExpertsRunner):
    """At 1 token (a decode kernel) reads topk_ids and topk_weights with dense strides."""

    def apply(self, inp):
        if isinstance(inp, StandardInput) and inp.hidden.shape[0] == 1:
            i, w = inp.topk_ids, inp.topk_weights
            inp = dataclasses.replace(
                inp,
                topk_ids=torch.as_strided(i, i.shape, (i.shape[1], 1)),
                topk_weights=torch.as_strided(w, w.shape, (w.shape[1], 1)),
            )
        return super().apply(inp)


class _Int32IdsAtDecodeRunner(_Int32IdsRunner):
    """Takes int64 ids as int32 at 1 token only."""

    def apply(self, inp):
        return super().apply(inp) if inp.hidden.shape[0] == 1 else ReferenceExpertsRunner.apply(self, inp)


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_one_token_result_is_checked_where_the_pipeline_claims_no_determinism(deterministic):
    """strided_inputs and input_dtypes compared the 1-token call bitwise only: for a pipeline
    that claims no determinism (as rocm.aiter) only the last size's result met the oracle."""
    results = []
    for check, runner, dispatcher in (
        ("strided_inputs", _DenseIdsAtDecodeRunner, None),
        ("input_dtypes", _Int32IdsAtDecodeRunner, _PassIdsDispatcher()),
    ):
        experts = _bf16_experts("decode", runner)
        type(experts).deterministic = deterministic
        suite = _suite("decode", experts, dispatcher)
        cases = [c for c in suite.cases() if c.check == check and c.layout == "standard" and c.pipeline is not None]
        assert cases and all(c.pipeline.deterministic is deterministic for c in cases)
        suite.run(cases)
        results += suite.results
    seen = [(r.check, r.status, r.detail) for r in results]
    assert {r.check for r in results} == {"strided_inputs", "input_dtypes"}, seen
    assert all(r.status == "fail" and r.detail.startswith("1 tokens: differs") for r in results), seen


class _WideOnlyRunner(FusedRunner):
    def __init__(self, req):
        self.ref = reference_layer(req.config, req.quant, "cpu", layout="standard", validate=False)

    def load(self, weights):
        self.ref.load_weights(weights)

    def forward(self, hidden, topk, router_logits):
        return self.ref(hidden, topk.ids, topk.weights)


class _WideOnlyFused(FusedForward):
    """A fused kernel with a minimum size (as Ascend FuseEP): hidden sizes from 512."""

    name = "wide"
    priority = 40
    devices = frozenset({"cpu"})
    quant_schemes = frozenset({moehal.QuantScheme.parse("bf16"), moehal.QuantScheme.parse("w8a8_int8")})

    def check_shape(self, req):
        from moehal.capability import accept, decline

        if req.config.hidden_size < 512:
            return decline(f"hidden_size {req.config.hidden_size} < 512", "shape")
        return accept(predicate="shape")

    def build(self, req):
        return _WideOnlyRunner(req)


def test_schemes_a_fused_kernel_takes_only_at_the_wide_shape_are_claimed():
    """Claims came from the base-shape matrix alone: a fused kernel with a minimum size claimed
    nothing, features/wide_512 was never built for it, and the verdict was NOTHING CLAIMED."""
    suite = _fused_suite("wide", _WideOnlyFused())
    cases = suite.cases()
    wide = [c for c in cases if c.id.startswith("features/") and "/wide_512/" in c.id and c.pipeline is not None]
    assert {c.quant.name for c in wide} == {"bf16", "w8a8_int8"}, [c.id for c in wide]
    assert {c.quant.name for c in cases if c.check == "out_buffer" and c.pipeline is not None} == {"bf16", "w8a8_int8"}
    suite.run(wide)
    assert {r.status for r in suite.results} == {"pass"}, [(r.id, r.detail) for r in suite.results]
    assert suite.claimed_anything and suite.ok


class _NanForGeluRunner(ReferenceExpertsRunner):
    def apply(self, inp):
        out = super().apply(inp)
        if self.config.activation is moehal.Activation.GELU:
            return type(out)(out.hidden * float("nan"))
        return out


def test_the_json_report_stays_json_when_a_case_fails_on_nan(tmp_path):
    """NaN and Infinity metrics (an output with NaN, or of the wrong shape) were written as bare
    `NaN`, which strict JSON parsers refuse: the whole report with them."""
    suite = _suite("nan", _bf16_experts("nan", _NanForGeluRunner))
    suite.run([c for c in suite.cases() if c.id.startswith(("matrix/bf16/gelu/", "matrix/bf16/silu/"))])
    assert any(r.status == "fail" and r.metrics["rel_l2"] != r.metrics["rel_l2"] for r in suite.results)
    js, md = report.write(suite, tmp_path / "nan")

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    data = json.loads(js.read_text(), parse_constant=strict)
    failed = [c for c in data["cases"] if c["status"] == "fail"]
    assert failed and all(c["metrics"] == {"rel_l2": None, "rel_max": None} for c in failed)
    assert all(c["metrics"]["rel_l2"] is not None for c in data["cases"] if c["status"] == "pass")
    assert "| nan |" in md.read_text()


def test_a_report_name_keeps_its_dots(tmp_path):
    """with_suffix took ".1" off "acme-0.1.1": two versions' reports overwrote each other."""
    suite = _reference_suite()
    for name in ("acme-0.1.1", "acme-0.1.2", "named.json", "other.md"):
        report.write(suite, tmp_path / name)
    names = {"acme-0.1.1", "acme-0.1.2", "named", "other"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}{s}" for n in names for s in (".json", ".md"))


def test_sigterm_during_the_ep_cases_keeps_the_report(monkeypatch, tmp_path):
    """`timeout` sends SIGTERM, which the CLI turns into KeyboardInterrupt so the report of what
    ran is kept; during `--ep` it escaped main(), and no report was written."""
    import os
    import signal
    import time

    def terminated(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises at once

    monkeypatch.setattr(Suite, "run_ep", terminated)
    before = signal.getsignal(signal.SIGTERM)
    try:
        # -k slots: 3 cases of the suite, and an EP case ("-1 ids: padded tokens and slots")
        code, data, verdict = _cli_report(tmp_path, "ep", "-k", "slots", "--ep", "2")
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main(): no report")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 3 and data["interrupted"] is True and data["summary"]["ok"] is False  # INCOMPLETE
    assert data["summary"]["pass"] > 0 and data["summary"]["not run"] == 1
    ep = data["cases"][-1]
    assert ep["id"] == "ep/world2" and ep["status"] == "not run" and "during the expert-parallel" in ep["detail"]
    assert verdict.startswith("**Verdict: INCOMPLETE (interrupted)")


def test_the_suites_registry_keeps_every_setting_of_the_environment(monkeypatch):
    """make_registry rebuilt Settings field by field and dropped the masked workspace budget:
    conformance then tested the layout a layer under that budget would not take."""
    from moehal_conformance.suite import make_registry

    monkeypatch.setenv("MOEHAL_MASKED_WORKSPACE_GIB", "0.5")
    monkeypatch.setenv("MOEHAL_BACKEND", "reference")
    monkeypatch.setenv("MOEHAL_EMULATE", "npu")
    settings = make_registry(frozenset({"rocm"})).settings
    assert settings.masked_workspace_gib == 0.5 == moehal.Settings.from_env().masked_workspace_gib
    assert settings.backend is None, "each case names its backend"
    assert settings.emulate == {"npu", "rocm"}


class _WholeBufferAmaxRunner(ReferenceExpertsRunner):
    """Right while padding rows hold zeros: it reads the whole grouped buffer (a global amax, as
    a quantizer over the buffer would), so NaN left in padding rows reaches every row."""

    def apply(self, inp):
        out = super().apply(inp)
        if isinstance(inp, (MaskedInput, ContiguousInput)):
            return dataclasses.replace(out, hidden=out.hidden + (inp.hidden.float().amax() * 0).to(out.hidden.dtype))
        return out


def test_experts_that_read_padding_rows_fail_the_padding_check_with_nan_padding():
    """DeepEP's low-latency dispatch leaves padding rows as they were (`zero_padding = False`):
    the padding cases run the experts again with NaN there, and experts that let padding rows
    reach live ones fail, though they pass while padding holds zeros."""

    class _Experts(ReferenceExperts):  # contiguous segments aligned to 8 rows: padding rows there too
        name = "amax"
        priority = 40
        quant_schemes = frozenset({moehal.QuantScheme.parse("bf16")})

        def input_formats(self, req):
            formats = super().input_formats(req)
            return [dataclasses.replace(f, row_alignment=8) if f.layout_name == "contiguous" else f for f in formats]

        def build(self, req, fmt):
            return _WholeBufferAmaxRunner(req, fmt)

    suite = _suite("amax", _Experts())
    padding = [c for c in suite.cases() if c.check == "padding" and c.pipeline is not None]
    assert {c.layout for c in padding} == {"masked", "contiguous"}
    suite.run(padding)
    assert suite.results and all(r.status == "fail" for r in suite.results), [(r.id, r.detail) for r in suite.results]
    assert all("with NaN in the input's padding rows" in r.detail for r in suite.results), suite.results
    good = [r for r in _reference_results("padding") if r.status != "declined"]
    assert good and all(r.status == "pass" and "also with NaN padding in" in r.detail for r in good), good


def test_a_dispatcher_that_leaves_padding_rows_is_not_held_to_zeros():
    """`Dispatcher.zero_padding = False` (DeepEP low latency): the dispatcher half of the
    padding check does not ask for zeros; experts are held to ignoring them either way."""

    class _StaleRunner(LocalDispatchRunner):
        def dispatch(self, hidden, topk):
            inp, handle = super().dispatch(hidden, topk)
            if isinstance(inp, MaskedInput):
                inp = with_dirty_padding(inp)
            return inp, handle

    class _Stale(ReferenceDispatcher):
        name = "stale"
        priority = 40

        def build(self, req, fmt):
            return _StaleRunner(req, fmt)

    def masked_padding(dispatcher):
        suite = _suite("stale", ReferenceExperts(), dispatcher)
        suite.run([c for c in suite.cases() if c.check == "padding" and c.layout == "masked" and c.pipeline])
        return [(r.status, r.detail) for r in suite.results]

    held = masked_padding(_Stale())
    assert held and all(s == "fail" and "padding rows are not zero" in d for s, d in held), held
    _Stale.zero_padding = False
    left = masked_padding(_Stale())
    assert left and all(s == "pass" for s, _ in left), left


class _WrongOutputRunner(ReferenceExpertsRunner):
    """Declares the contiguous layout, returns its rows as a StandardOutput (a vendor slip)."""

    def apply(self, inp):
        return StandardOutput(super().apply(inp).hidden)


class _WrongOutput(_ContiguousExperts):
    name = "wrongout"

    def build(self, req, fmt):
        return _WrongOutputRunner(req, fmt)


def test_an_experts_output_of_the_wrong_kind_is_a_contract_error_naming_it():
    """The reference combine took a StandardOutput of the contiguous rows as token-major output:
    a 5-token forward returned 10+ rows, with no error."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    ns = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: BackendInfo("wrongout", "9.9", "throwaway")),
        moehal_experts=moehal.hookimpl(lambda: [_WrongOutput()]),
    )
    assert reg.register(ns, "wrongout").status == "loaded"
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    layer = moehal.MoELayer(cfg, device="cpu", backend="wrongout", registry=reg)
    g = torch.Generator().manual_seed(0)
    layer.load_weights(
        w13=torch.randn(4, 32, 32, generator=g).bfloat16(), w2=torch.randn(4, 32, 16, generator=g).bfloat16()
    )
    x, ids = torch.randn(5, 32).bfloat16(), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    with pytest.raises(moehal.ContractError, match="StandardOutput of shape .* for 5 tokens .*contiguous"):
        layer(x, ids, torch.rand(5, 2))


def test_the_cli_puts_the_callers_sigterm_handler_back(capsys):
    """main() installed its interrupting handler for good: in a test process, a later SIGTERM
    (a CI timeout) became an interrupted suite whose session could still pass."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    conformance_main(["--backend", "reference", "--device", "cpu", "--quick", "-k", "matrix/bf16/silu"])
    assert signal.getsignal(signal.SIGTERM) is before


_HOSTILE = "<script>alert(1)</script> & [click](javascript:alert(1)) | a\n<img src=x onerror=alert(2)>"


class _HostileDeclines(ReferenceExperts):
    name = "hostile"
    priority = 40

    def check_hardware(self, req):
        from moehal.capability import decline

        return decline(_HOSTILE)


def test_plugin_text_in_the_markdown_report_cannot_inject_html_or_links():
    """Decline reasons, error details and names come from a third-party plugin, and mkdocs
    publishes committed reports with their inline HTML as is (security review, finding 11):
    the report shows that text, escaped, and makes no tag, link or new line of it."""
    markdown = pytest.importorskip("markdown")

    suite = _suite("hostile", _HostileDeclines())
    suite.run([c for c in suite.cases() if c.check != "honesty"][:3])
    declined = [r for r in suite.results if r.status == "declined"]
    assert declined and all(_HOSTILE in r.detail for r in declined)
    md = report.to_markdown(suite)
    assert "<script" not in md and "<img" not in md and "[click](" not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; [click\\](javascript:alert(1)) \\| a &lt;img" in md
    page = markdown.markdown(md, extensions=["tables"])
    assert "<script" not in page and "<img" not in page and "<a " not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; [click](javascript:alert(1)) | a &lt;img" in page


def test_report_code_spans_hold_any_backticks_on_one_line():
    from moehal.cli import markdown as md

    assert md.code("cuda.triton") == "`cuda.triton`"
    assert md.code("a`b\nc") == "``a`b c``"
    assert md.code("`x`") == "`` `x` ``"
