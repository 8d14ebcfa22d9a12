"""Running one conformance case against the backend and the reference oracle."""

from __future__ import annotations

import sys
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from moehal.errors import InputError, MoEHalError, WeightsAlreadyProcessedError
from moehal.formats import ContiguousInput, ContiguousOutput, MaskedInput, MaskedOutput, padding_rows
from moehal.graphs import capture
from moehal.hardware import detect
from moehal.interfaces import BuildRequest
from moehal.layer import MoELayer
from moehal.plugins import Registry
from moehal.poison import poisoned
from moehal.reference.oracle import reference_layer
from moehal.weights import ExpertWeights, quantize_weights
from moehal_conformance.cases import Case
from moehal_conformance.tolerances import Tolerance, compare, tolerance_for

PASS, FAIL, DECLINED, NOT_RUN = "pass", "fail", "declined", "not run"


@dataclass
class CaseResult:
    id: str
    family: str
    check: str
    quant: str
    layout: str
    pipeline: str
    status: str  # pass | fail | declined | not run
    mode: str = "native"  # native | emulated | interpreted
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    traceback: str = ""  # a failure's, for the JSON report

    @property
    def label(self) -> str:
        if self.status == PASS and self.mode != "native":
            return f"pass ({self.mode})"
        if self.status in (DECLINED, NOT_RUN):
            return f"{self.status}: {self.detail}"
        return self.status


def context_lost(device: torch.device) -> str | None:
    """Why `device` can no longer run work in this process, or None. A fault in a kernel (an
    illegal address or instruction, a trap) leaves a CUDA context unusable: every later call
    raises the same error, so the cases after it would fail for a reason that is not theirs."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as exc:  # noqa: BLE001 - any error here means the context is gone
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return None


@dataclass
class Problem:
    weights: ExpertWeights
    x: torch.Tensor
    ids: torch.Tensor
    wts: torch.Tensor
    logits: torch.Tensor | None = None


def make_problem(case: Case) -> Problem:
    cfg, t = case.config, case.tokens
    gen = torch.Generator().manual_seed(1000 + case.seed)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(e, cfg.w13_rows, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    b13 = torch.randn(e, cfg.w13_rows, generator=gen) * 0.1 if cfg.has_w13_bias else None
    b2 = torch.randn(e, h, generator=gen) * 0.1 if cfg.has_w2_bias else None
    bias = None
    if cfg.routing is not None and cfg.routing.has_correction_bias:
        bias = torch.randn(cfg.num_experts, generator=gen) * 0.05
    x = torch.randn(t, h, generator=gen)
    weights = quantize_weights(
        cfg, case.quant, w13, w2, w13_bias=b13, w2_bias=b2, correction_bias=bias, calibration_input=x
    )
    k, n = cfg.top_k, cfg.num_experts
    if case.pattern == "one_expert":
        ids = torch.zeros(t, k, dtype=torch.int32) + torch.arange(k, dtype=torch.int32)
    elif case.pattern == "few_experts":  # only the first k+1 experts receive tokens
        ids = torch.stack([torch.randperm(k + 1, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    elif case.pattern == "other_ranks":  # every slot goes to an expert this rank does not own
        others = [j for j in range(n) if j not in cfg.local_experts]
        ids = torch.tensor([[others[j] for j in torch.randperm(len(others), generator=gen)[:k]] for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    wts = torch.rand(t, k, generator=gen) + 0.1
    logits = torch.randn(t, n, generator=gen) * 2 if cfg.routing is not None else None
    return Problem(weights, x.to(cfg.dtype), ids.to(torch.int32), wts, logits)


class CaseRunner:
    """Runs cases on `device`; the oracle is the reference backend on the CPU. With `poison`,
    every check runs inside `poison.poisoned()`: fresh allocations hold NaN (or 1), not
    whatever the allocator last freed."""

    def __init__(self, registry: Registry, device: torch.device, poison: bool = True) -> None:
        self.registry, self.device, self.poison = registry, device, poison
        self.poisoned = 0  # allocations poisoned so far (the report's evidence that it happened)
        self._tuned: tuple[tuple[Any, ...], ExpertWeights, MoELayer] | None = None  # `_tuned_weights`

    def _oracle(self, case: Case, prob: Problem) -> torch.Tensor:
        # reference_layer, not MoELayer(backend="reference"): that forces the reference experts
        # only, and a CPU dispatcher of the backend under test would sit in the oracle too.
        ref = reference_layer(case.config, case.quant, "cpu", layout="standard", registry=self.registry, validate=False)
        ref.load_weights(prob.weights)
        if prob.logits is not None:
            return ref(prob.x, router_logits=prob.logits.to(case.logits_dtype))
        return ref(prob.x, prob.ids, prob.wts)

    def _layer(self, case: Case, **kw: Any) -> MoELayer:
        return MoELayer(
            case.config,
            case.quant,
            device=self.device,
            registry=self.registry,
            pipeline=case.pipeline,
            validate=kw.pop("validate", False),
            **kw,
        )

    def run(self, case: Case) -> CaseResult:
        p = case.pipeline
        res = CaseResult(
            case.id, case.family, case.check, case.quant.name, case.layout, p.name if p is not None else "-", FAIL
        )
        if case.check == "honesty":
            return self._honesty(case, res)
        if case.error is not None:
            res.status, res.detail = FAIL, f"a capability check raised for {case.config.describe()}: {case.error}"
            return res
        if p is None:
            res.status, res.detail = DECLINED, case.declined or "no reason given"
            if not case.declined:
                res.status, res.detail = FAIL, "declined without a reason"
            elif case.family == "tuned":  # the implementation declared it runs there
                res.status = FAIL
            return res
        if case.check == "cuda_graph" and self.device.type != "cuda":
            res.status, res.detail = NOT_RUN, f"CUDA graphs need a CUDA device; this run is on {self.device.type}"
            return res
        if case.check in ("side_stream", "two_streams") and self.device.type != "cuda":
            res.status, res.detail = NOT_RUN, f"CUDA streams need a CUDA device; this run is on {self.device.type}"
            return res
        if case.check == "cuda_graph" and not p.graph_capturable:
            res.status, res.detail = NOT_RUN, "the pipeline does not claim CUDA-graph capture"
            return res
        if case.check == "determinism" and not p.deterministic:
            res.status, res.detail = NOT_RUN, "the pipeline does not claim determinism"
            return res
        try:
            res.mode = p.execution_mode(
                BuildRequest(case.config, case.quant, detect(self.device), self.registry.settings)
            )
            with poisoned(self.poison) as mode:
                try:
                    getattr(self, f"_check_{case.check}")(case, res)
                finally:
                    self.poisoned += mode.poisoned if mode is not None else 0
            if self.device.type == "cuda":
                # Kernels fault asynchronously: a fault shows at the next synchronizing call, which
                # may be a later case's. Waiting here pins it on the case that launched it.
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any exception in a claimed case is a failure
            res.status = FAIL
            res.detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            res.traceback = traceback.format_exc()[-4000:]
        return res

    # Checks -------------------------------------------------------------------------------
    def _forward(self, case: Case, layer: MoELayer, prob: Problem) -> torch.Tensor:
        d = self.device
        if prob.logits is not None:
            return layer(prob.x.to(d), router_logits=prob.logits.to(d, case.logits_dtype))
        return layer(prob.x.to(d), prob.ids.to(d), prob.wts.to(d))

    def _numeric(
        self, case: Case, res: CaseResult, out: torch.Tensor, prob: Problem, oracle: MoELayer | None = None
    ) -> None:
        # compare() looks at values only: an output in another dtype or on another device than
        # the layer's (an engine adds it to its residual) would pass on its numbers.
        d = self.device
        if out.dtype != case.config.dtype or out.device.type != d.type or d.index not in (None, out.device.index):
            res.status = FAIL
            res.detail = f"output is {out.dtype} on {out.device}; the layer's is {case.config.dtype} on {d}"
            return
        ref = self._oracle(case, prob) if oracle is None else oracle(prob.x, prob.ids, prob.wts)
        c = compare(out.cpu(), ref, tolerance_for(case.quant, case.config.dtype))
        res.metrics.update(rel_l2=c.rel_l2, rel_max=c.rel_max)
        res.status, res.detail = (PASS if c.ok else FAIL), c.detail

    def _agreeing(
        self, case: Case, res: CaseResult, problems: list[str], out: torch.Tensor, prob: Problem, what: str, exact: str
    ) -> None:
        """The tail of the checks that compare a variant call with the plain one: fail with the
        problems found, else score `out` against the oracle, the detail naming the variant
        (`what`) and, where the pipeline claims determinism, the bitwise agreement (`exact`)."""
        if problems:
            res.status, res.detail = FAIL, "; ".join(problems)
            return
        self._numeric(case, res, out, prob)
        deterministic = case.pipeline is not None and case.pipeline.deterministic
        res.detail = f"{what}: {res.detail}" + (f", {exact}" if deterministic else "")

    def _check_numeric(self, case: Case, res: CaseResult) -> None:
        if case.family == "tuned":
            self._check_tuned(case, res)
            return
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        self._numeric(case, res, self._forward(case, layer, prob), prob)

    _check_logits = _check_numeric

    def _tuned_weights(self, case: Case) -> tuple[ExpertWeights, MoELayer]:
        """A tuned shape's weights on the device and the oracle loaded with them on the CPU,
        kept for the shape's next case: model-sized weights (gigabytes) are drawn once per
        (shape, scheme), on the device, where drawing and quantizing them takes milliseconds."""
        key = (case.config, case.quant.name, case.seed)
        if self._tuned is not None and self._tuned[0] == key:
            return self._tuned[1], self._tuned[2]
        self._tuned = None  # the previous shape's tensors go first
        cfg, d = case.config, self.device
        gen = torch.Generator(d).manual_seed(1000 + case.seed)
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        w13 = torch.randn(e, cfg.w13_rows, h, generator=gen, device=d) / h**0.5
        w2 = torch.randn(e, h, i, generator=gen, device=d) / i**0.5
        b13 = torch.randn(e, cfg.w13_rows, generator=gen, device=d) * 0.1 if cfg.has_w13_bias else None
        b2 = torch.randn(e, h, generator=gen, device=d) * 0.1 if cfg.has_w2_bias else None
        calib = torch.randn(64, h, generator=gen, device=d)  # static input scales (fp8_tensor) from it
        weights = quantize_weights(cfg, case.quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=calib)
        del w13, w2
        oracle = reference_layer(cfg, case.quant, "cpu", layout="standard", registry=self.registry, validate=False)
        oracle.load_weights(weights.to("cpu"))
        self._tuned = (key, weights, oracle)
        return weights, oracle

    def _check_tuned(self, case: Case, res: CaseResult) -> None:
        weights, oracle = self._tuned_weights(case)
        cfg, t = case.config, case.tokens
        gen = torch.Generator().manual_seed(2000 + case.seed + t)
        x = torch.randn(t, cfg.hidden_size, generator=gen).to(cfg.dtype)
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(t)])
        ids = ids.to(torch.int32)
        wts = torch.rand(t, cfg.top_k, generator=gen) + 0.1
        layer = self._layer(case)
        # a copy: a weight processor may keep or transform what it is given
        layer.load_weights(weights.replace(**{k: v.clone() for k, v in weights.tensors().items()}))
        d = self.device
        out = layer(x.to(d), ids.to(d), wts.to(d))
        del layer
        prob = Problem(weights, x, ids, wts)
        self._numeric(case, res, out, prob, oracle=oracle)

    @staticmethod
    def _dispatch_problem(case: Case, prob: Problem, disp: Any) -> tuple[str | None, torch.Tensor | None]:
        """The dispatcher's half of the grouped formats' contract, on a traced dispatch output:
        (what is wrong or None, the padding rows as a bool mask, None for a token-major input).
        Masked: masked_m counts each local expert's slots, and the host bound experts size their
        grids by covers them. Contiguous: row_expert names the live rows only. Both: padding
        rows hold zeros, where the dispatcher declares it (`Dispatcher.zero_padding`)."""
        if isinstance(disp, MaskedInput):
            local = torch.tensor(list(case.config.local_experts), dtype=torch.int64)
            want = (prob.ids.long().reshape(-1, 1) == local[None, :]).sum(0)
            got_m = disp.masked_m.long().cpu()
            if not torch.equal(got_m, want):
                return f"masked_m is {got_m.tolist()}; the slots per local expert are {want.tolist()}", None
            if disp.max_total_rows is not None and disp.max_total_rows < int(want.sum()):
                return f"max_total_rows {disp.max_total_rows} is under the {int(want.sum())} rows dispatched", None
            pad = padding_rows(disp)
        elif isinstance(disp, ContiguousInput):
            live = disp.live_rows()
            wrong = torch.nonzero((disp.row_expert >= 0) != live).flatten()
            if wrong.numel():
                return (
                    f"row_expert marks {wrong.numel()} rows wrongly (first: row {int(wrong[0])}): "
                    "a token's row carries its expert, padding rows and the tail -1"
                ), None
            pad = ~live  # none where the format's alignment is 1 and the batch fills the rows
        else:
            return None, None
        dispatcher = case.pipeline.dispatcher if case.pipeline is not None else None
        zeros = dispatcher is None or dispatcher.zero_padding
        # (upcast first: torch before 2.7 cannot index a CPU fp8 tensor with a mask)
        dirty = disp.hidden.float()[pad].abs().max().item() if pad.any() and zeros else 0.0
        if dirty != 0.0:  # the formats' contract: padding rows hold zeros in, too
            return f"the dispatched input's padding rows are not zero (max |value| {dirty:.3g})", pad
        return None, pad

    def _check_padding(self, case: Case, res: CaseResult) -> None:
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        d = self.device
        # The main format's padding, whatever the batch size: a pipeline whose small-batch
        # format (token-major, no padding rows) takes this many tokens is still checked here.
        stages = layer.trace(prob.x.to(d), prob.ids.to(d), prob.wts.to(d), path="main")
        disp, y = stages["adapted"], stages["expert_out"]
        grouped = (isinstance(disp, MaskedInput) and isinstance(y, MaskedOutput)) or (
            isinstance(disp, ContiguousInput) and isinstance(y, ContiguousOutput)
        )
        if not grouped:
            raise TypeError(f"expected masked or contiguous input/output, got {type(disp).__name__}/{type(y).__name__}")
        wrong, pad = self._dispatch_problem(case, prob, disp)
        if wrong is not None:
            res.status, res.detail = FAIL, wrong
            return
        assert pad is not None
        if isinstance(disp, MaskedInput) and not bool(pad.any()):
            raise AssertionError("the problem has no padding rows; the case is mis-built")
        leaked = y.hidden[pad].float().abs().max().item() if pad.any() else 0.0
        if leaked != 0.0:
            res.status, res.detail = FAIL, f"padding rows are not zero (max |value| {leaked:.3g}); with biases set"
            return
        self._numeric(case, res, stages["out"], prob)
        if res.status != PASS:
            return
        # Again with NaN in the input's padding rows, as a dispatcher that leaves them as they
        # were (DeepEP low latency) hands them over: experts must keep them from live rows
        # and still leave zeros in their output's padding rows.
        dirty = layer.trace(prob.x.to(d), prob.ids.to(d), prob.wts.to(d), path="main", dirty_padding=True)
        leaked = dirty["expert_out"].hidden[pad].float().abs().max().item() if pad.any() else 0.0
        if leaked != 0.0:
            res.status = FAIL
            res.detail = f"with NaN in the input's padding rows, the output's padding rows are not zero ({leaked:.3g})"
            return
        if not bool(torch.isfinite(dirty["out"]).all()):
            res.status, res.detail = FAIL, "NaN in the input's padding rows reached the output's live rows"
            return
        self._numeric(case, res, dirty["out"], prob)
        res.detail = "padding rows zero, also with NaN padding in; " + res.detail

    def _check_dispatch(self, case: Case, res: CaseResult) -> None:
        """A pairing of dispatcher and experts (`pairs`): the traced dispatch output keeps the
        formats' contract (`_dispatch_problem`, at the pairing's top-k), and the result matches."""
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        d = self.device
        stages = layer.trace(prob.x.to(d), prob.ids.to(d), prob.wts.to(d), path="main")
        wrong, _ = self._dispatch_problem(case, prob, stages["adapted"])
        if wrong is not None:
            res.status, res.detail = FAIL, wrong
            return
        self._numeric(case, res, stages["out"], prob)

    def _check_determinism(self, case: Case, res: CaseResult) -> None:
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        a, b = self._forward(case, layer, prob), self._forward(case, layer, prob)
        same = torch.equal(a, b)
        res.status, res.detail = (PASS, "bitwise equal twice") if same else (FAIL, "two runs differ bitwise")

    def _check_cuda_graph(self, case: Case, res: CaseResult) -> None:
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        x, ids, w = (t.to(self.device) for t in (prob.x, prob.ids, prob.wts))
        eager = layer(x, ids, w)
        # two warm-up calls on a side stream, then the capture (moehal.graphs.capture says why)
        graph, static_out = capture(lambda: layer(x, ids, w), self.device, warmup=2)
        # New inputs copied into the captured buffers must flow through the replay.
        prob2 = make_problem(Case(**{**case.__dict__, "seed": case.seed + 1}))
        x.copy_(prob2.x.to(self.device))
        ids.copy_(prob2.ids.to(self.device))
        w.copy_(prob2.wts.to(self.device))
        graph.replay()
        torch.cuda.synchronize()
        again = layer(x, ids, w)
        c = compare(static_out.cpu(), again.cpu(), tolerance_for(case.quant, case.config.dtype))
        equal = torch.equal(static_out, again)
        res.status = PASS if (equal or c.ok) else FAIL
        res.detail = "replay equals eager bitwise" if equal else f"replay vs eager: {c.detail}"
        del eager

    def _check_side_stream(self, case: Case, res: CaseResult) -> None:
        """The forward on a stream other than the default one, as engines overlap work: every
        kernel must run on the caller's current stream. That stream first sleeps, then writes
        the inputs, then runs the forward; a kernel launched on another stream reads the inputs
        (or a stage's output) before they are written, and the result differs from the same
        inputs' forward on the default stream. At 1 token and at the case's size."""
        prob = make_problem(case)
        new = make_problem(Case(**{**case.__dict__, "seed": case.seed + 1}))
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        d = self.device
        tol = tolerance_for(case.quant, case.config.dtype)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems = []
        for t in sorted({1, prob.x.shape[0]}):
            x, ids, w = (v[:t].to(d) for v in (prob.x, prob.ids, prob.wts))
            x2, ids2, w2 = (v[:t].to(d) for v in (new.x, new.ids, new.wts))
            want = layer(x2, ids2, w2).cpu()
            layer(x, ids, w)  # first calls of this size (binds, allocations) on the default stream
            torch.cuda.synchronize(d)
            side = torch.cuda.Stream(d)
            side.wait_stream(torch.cuda.current_stream(d))
            with torch.cuda.stream(side):
                torch.cuda._sleep(100_000_000)  # ~50-70 ms at GPU clocks: what runs elsewhere goes first
                x.copy_(x2)
                ids.copy_(ids2)
                w.copy_(w2)
                got = layer(x, ids, w)
            torch.cuda.current_stream(d).wait_stream(side)
            torch.cuda.synchronize(d)
            why = self._differs(got, want, tol, exact)
            if why:
                problems.append(f"{t} tokens: differs from the default stream's forward ({why})")
        self._verdict(res, problems, "forwards on a side stream equal the default stream's", exact)

    @staticmethod
    def _differs(got: torch.Tensor, want: torch.Tensor, tol: Tolerance, exact: bool) -> str | None:
        """Why `got` is not `want`: beyond the tolerance, or not bitwise equal where the
        pipeline claims determinism (`exact`); None when it is."""
        if got.dtype != want.dtype:
            return f"dtype {got.dtype} != {want.dtype}"
        got, want = got.cpu(), want.cpu()
        c = compare(got, want, tol)
        return c.detail if (exact and not torch.equal(got, want)) or not c.ok else None

    @staticmethod
    def _verdict(res: CaseResult, problems: list[str], passed: str, exact: bool) -> None:
        """FAIL with the problems, or PASS saying what held (bitwise where `exact`)."""
        res.status = FAIL if problems else PASS
        res.detail = "; ".join(problems) or passed + (" (bitwise)" if exact else "")

    def _check_two_streams(self, case: Case, res: CaseResult) -> None:
        """Two layers of one shape (different weights and inputs) queued on two streams at
        once, as two-batch overlap or a side stream runs them. Both streams wait for one gate
        (a third stream that sleeps), so their forwards become ready together; each result must
        equal the same layer's forward on the default stream (bitwise where the pipeline claims
        determinism). Buffers that a backend shares between layers of one shape and that nothing
        orders across streams are written by both forwards at once. At 1 token and at the
        case's size."""
        prob = make_problem(case)
        other = make_problem(Case(**{**case.__dict__, "seed": case.seed + 1}))
        d = self.device
        layers = []
        for p in (prob, other):
            layer = self._layer(case)
            layer.load_weights(p.weights.to(d))
            layers.append(layer)
        tol = tolerance_for(case.quant, case.config.dtype)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems = []
        for t in sorted({1, prob.x.shape[0]}):
            inputs = [tuple(v[:t].to(d) for v in (p.x, p.ids, p.wts)) for p in (prob, other)]
            wants = [layer(*xs).cpu() for layer, xs in zip(layers, inputs, strict=True)]
            torch.cuda.synchronize(d)
            gate, streams = torch.cuda.Stream(d), [torch.cuda.Stream(d) for _ in layers]
            with torch.cuda.stream(gate):
                torch.cuda._sleep(100_000_000)  # ~50-70 ms: both forwards are queued before it ends
            opened = gate.record_event()
            gots = []
            for layer, xs, stream in zip(layers, inputs, streams, strict=True):
                stream.wait_event(opened)
                with torch.cuda.stream(stream):
                    gots.append(layer(*xs))
            for stream in streams:
                torch.cuda.current_stream(d).wait_stream(stream)
            torch.cuda.synchronize(d)
            for name, got, want in zip(("first", "second"), gots, wants, strict=True):
                why = self._differs(got, want, tol, exact)
                if why:
                    problems.append(f"{t} tokens, {name} layer: differs from its default-stream forward ({why})")
        self._verdict(res, problems, "two layers' forwards on two streams at once equal their own", exact)

    def _check_inference_mode(self, case: Case, res: CaseResult) -> None:
        """First forwards under `torch.inference_mode()`, as engines serve, then the same
        under `torch.no_grad()` (a harness, a profile run): both must work and agree (bitwise
        where the pipeline claims determinism). Buffers a pipeline keeps across calls and first
        allocates in inference mode are inference tensors, which torch refuses to update in
        place outside it. moehal's process-wide workspaces are released first, so this case
        allocates its own in inference mode."""
        kernels = sys.modules.get("moehal.kernels.triton_permute")  # (imported only where they run)
        if kernels is not None:
            kernels.release_workspaces(self.device)
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        x, ids, w = (t.to(self.device) for t in (prob.x, prob.ids, prob.wts))
        sizes = sorted({1, x.shape[0]})
        with torch.inference_mode():
            served = [layer(x[:t], ids[:t], w[:t]) for t in sizes]
        tol = tolerance_for(case.quant, case.config.dtype)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems = []
        with torch.no_grad():
            for t, want in zip(sizes, served, strict=True):
                got = layer(x[:t], ids[:t], w[:t])
                why = self._differs(got, want, tol, exact)
                if why:
                    problems.append(f"{t} tokens: no_grad differs from inference_mode ({why})")
        self._agreeing(case, res, problems, got, prob, "inference_mode, then no_grad", "bitwise equal")

    def _check_out_buffer(self, case: Case, res: CaseResult) -> None:
        """`layer(..., out=buf)` writes the result into the caller's buffer and returns that
        buffer, as a call without `out` would compute it (bitwise where the pipeline claims
        determinism), at one token (a decode batch: experts that finish the combine themselves
        write `buf`) and at the case's size; and in place (`out=hidden_states`), where the
        pipeline must still read its input before writing its result."""
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        x, ids, w = (t.to(self.device) for t in (prob.x, prob.ids, prob.wts))
        tol = tolerance_for(case.quant, case.config.dtype)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems, checked = [], 0
        for t in sorted({1, x.shape[0]}):
            want = layer(x[:t], ids[:t], w[:t]).cpu()
            for how in ("out=", "in place"):
                buf = x[:t].clone() if how == "in place" else torch.full_like(x[:t], float("nan"))
                inp = buf if how == "in place" else x[:t]
                got = layer(inp, ids[:t], w[:t], out=buf)
                checked += 1
                if got is not buf:
                    problems.append(f"{t} tokens, {how}: returned a new tensor, not out")
                    continue
                why = self._differs(buf, want, tol, exact)
                if why:
                    problems.append(f"{t} tokens, {how}: differs from the call without out ({why})")
        self._verdict(res, problems, f"{checked} calls wrote out as the plain call computes", exact)

    def _check_strided_inputs(self, case: Case, res: CaseResult) -> None:
        """Inputs as engines may hold them: hidden_states a view of wider rows (row stride past
        H), column-major, or dense but starting one element past an aligned address (contiguous,
        so `.contiguous()` keeps it; a kernel moving rows in 16-byte vectors would fault or read
        wrong), topk_ids and topk_weights column-major views (`[T, K]` read from `[K, T]`). The
        result must match the oracle, and equal the call on contiguous copies bitwise where the
        pipeline claims determinism. A kernel that indexes its inputs as if they were dense
        reads the wrong rows here, silently."""
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        d, h = self.device, case.config.hidden_size
        x, ids, w = (t.to(d) for t in (prob.x, prob.ids, prob.wts))
        # NaN past each row: a kernel that reads past H (a K tail loaded unmasked, times masked
        # zero weights) turns it into NaN here, where zeros would hide it (session 45's audit)
        wide = torch.full((x.shape[0], h + 64), float("nan"), dtype=x.dtype, device=d)
        wide[:, :h] = x
        xs = wide[:, :h]  # row stride h + 64
        ids_s, w_s = ids.t().contiguous().t(), w.t().contiguous().t()  # strides (1, T)
        if x.shape[0] > 1 and (xs.is_contiguous() or ids_s.is_contiguous() or w_s.is_contiguous()):
            raise AssertionError("the strided inputs came out contiguous; the case is mis-built")
        tol = tolerance_for(case.quant, case.config.dtype)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems = []
        for t in sorted({1, x.shape[0]}):
            want = layer(x[:t], ids[:t], w[:t])
            got = layer(xs[:t], ids_s[:t], w_s[:t])
            # every size, not bitwise only: the oracle sees the last size's result alone
            why = self._differs(got, want, tol, exact)
            if why:
                problems.append(f"{t} tokens: differs from the call on contiguous inputs ({why})")
            # hidden_states column-major (a transposed activation): same values, column stride T
            why = self._differs(layer(x[:t].t().contiguous().t(), ids[:t], w[:t]), want, tol, exact)
            if why:
                problems.append(f"{t} tokens, column-major hidden_states: differs from contiguous ({why})")
            odd = torch.empty(t * h + 1, dtype=x.dtype, device=d)[1:].view(t, h)  # one element off
            odd.copy_(x[:t])
            why = self._differs(layer(odd, ids[:t], w[:t]), want, tol, exact)
            if why:
                problems.append(f"{t} tokens, hidden_states one element past an aligned address: ({why})")
        self._agreeing(case, res, problems, got, prob, "strided inputs", "bitwise equal to contiguous inputs")

    def _check_input_dtypes(self, case: Case, res: CaseResult) -> None:
        """The other dtypes the layer accepts: topk_ids int64 (what `torch.topk` returns) and
        topk_weights in the layer dtype. The result must match the oracle given the same
        weights, and equal the call with int32 ids and those weights in fp32 bitwise where the
        pipeline claims determinism (the conversion is exact)."""
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        d, dt = self.device, case.config.dtype
        x, ids = prob.x.to(d), prob.ids.to(d)
        w = prob.wts.to(d, dt)  # the router weights as the layer dtype holds them
        tol = tolerance_for(case.quant, dt)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems = []
        for t in sorted({1, x.shape[0]}):
            want = layer(x[:t], ids[:t], w[:t].float())
            got = layer(x[:t], ids[:t].long(), w[:t])
            why = self._differs(got, want, tol, exact)  # every size, as in _check_strided_inputs
            if why:
                problems.append(f"{t} tokens: differs from int32 ids and fp32 weights ({why})")
        what = f"int64 ids, {str(dt).removeprefix('torch.')} weights"
        rounded = replace(prob, wts=prob.wts.to(dt).float())  # the weights the layer was given
        self._agreeing(case, res, problems, got, rounded, what, "bitwise equal to int32 ids and fp32 weights")

    def _check_row_isolation(self, case: Case, res: CaseResult) -> None:
        """Tokens whose hidden states hold NaN or Inf (the stale rows of a padded CUDA-graph
        batch, an activation that overflowed) change no other token's output: every other row
        must equal the forward without them (bitwise where the pipeline claims determinism) and
        match the oracle, at 3 tokens (where a small-batch format takes a decode batch) and at
        the case's size. A kernel that reduces across tokens (an activation scale taken from the
        batch's max, a sum that weighs other tokens' rows by zero) spreads them to every row.
        Then a clean batch of 3 tokens must equal its forward before the dirty ones: NaN left in
        a buffer the layer keeps across calls, read by a later, smaller batch, shows there."""
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device))
        d = self.device
        x, ids, w = (t.to(d) for t in (prob.x, prob.ids, prob.wts))
        bad = torch.zeros(x.shape[0], dtype=torch.bool)
        bad[1::3] = True  # tokens 1, 4, 7, ... hold NaN; token 2 holds +-Inf
        dirty = x.clone()
        dirty[bad.to(d)] = float("nan")
        if x.shape[0] > 2:
            bad[2] = True
            dirty[2, ::2], dirty[2, 1::2] = float("inf"), float("-inf")
        tol = tolerance_for(case.quant, case.config.dtype)
        exact = case.pipeline is not None and case.pipeline.deterministic
        problems = []
        small = min(3, x.shape[0])
        before = layer(x[:small], ids[:small], w[:small]).clone()
        for t in sorted({small, x.shape[0]}):
            keep = ~bad[:t]
            want = layer(x[:t], ids[:t], w[:t])[keep.to(d)]
            with warnings.catch_warnings():  # NaN in, as meant: an interpreter's numpy says so
                warnings.simplefilter("ignore", RuntimeWarning)
                got = layer(dirty[:t], ids[:t], w[:t])[keep.to(d)]
            why = self._differs(got, want, tol, exact)
            if why:
                problems.append(f"{t} tokens, {int((~keep).sum())} of them NaN or Inf: the others changed ({why})")
        why = self._differs(layer(x[:small], ids[:small], w[:small]), before, tol, exact)
        if why:
            problems.append(f"a clean batch of {small} after the NaN ones differs from before them ({why})")
        if problems:
            res.status, res.detail = FAIL, "; ".join(problems)
            return
        # the oracle is row-independent: its rows of the clean batch are the other tokens' answer
        c = compare(got.cpu(), self._oracle(case, prob)[~bad], tol)
        res.metrics.update(rel_l2=c.rel_l2, rel_max=c.rel_max)
        res.status = PASS if c.ok else FAIL
        res.detail = f"{int(bad.sum())} of {x.shape[0]} tokens NaN or Inf, the others: {c.detail}"
        if exact and c.ok:
            res.detail += ", bitwise equal to the clean batch's rows"

    def _check_kept_outputs(self, case: Case, res: CaseResult) -> None:
        """A forward's output is the caller's to keep, as any eager result is: engines hold one
        while the same layer runs again (two-batch overlap runs a layer on the second micro-batch
        before the first one's output is consumed) and while other layers of its shape run. Each
        output must keep its values through later forwards: the same layer on other inputs of
        the same size, on 1 token (where a small-batch format takes it), and a second layer of
        this shape. A backend that returns a view of a buffer it keeps across calls (its own, or
        one shared by the layers of a shape) fails here, naming the call that overwrote it."""
        prob = make_problem(case)
        d = self.device
        layer, other = self._layer(case), self._layer(case)
        layer.load_weights(prob.weights.to(d))
        # weights of its own: a layer's weights are its to keep (and, for some kernels, to
        # transform), never shared with another layer
        other.load_weights(make_problem(replace(case, seed=case.seed + 1)).weights.to(d))
        x, ids, w = (t.to(d) for t in (prob.x, prob.ids, prob.wts))
        x2, ids2, w2 = -x.flip(0), ids.flip(0), w.flip(0)  # other values, the same size
        first = layer(x, ids, w)
        held = [("the first output", first, first.clone())]
        later = (
            ("the same layer on other inputs", lambda: layer(x2, ids2, w2)),
            ("the same layer on 1 token", lambda: layer(x[:1], ids[:1], w[:1])),
            ("a second layer of this shape", lambda: other(x2, ids2, w2)),
        )
        problems = []
        for n, (what, call) in enumerate(later):
            y = call()
            for name, kept, snapshot in held:
                if not torch.equal(kept.contiguous().view(torch.uint8), snapshot.view(torch.uint8)):  # bits: NaN too
                    problems.append(f"{name} changed when {what} ran")
            held = [(name, kept, kept.clone()) for name, kept, _ in held]  # a change is named once
            held.append((f"output {n + 2} ({what})", y, y.clone()))
        if problems:
            res.status, res.detail = FAIL, "; ".join(problems)
            return
        self._numeric(case, res, first, prob)
        res.detail = f"every output kept its bits through {len(later)} later forwards; the first: {res.detail}"

    def _check_padded_ids(self, case: Case, res: CaseResult) -> None:
        """-1 top-k ids (`MoEConfig.topk_padding`, declared by the pipeline's dispatcher or fused
        forward): every third token is padding (all its slots -1) and tokens 1, 5, ... lose their
        first slot. The result must match the oracle, which drops those slots, and padded
        tokens' rows must be exactly zero. At 3 tokens (a decode batch: a small-batch format
        takes it where the pipeline has one) and at the case's size."""
        problems, rows = [], 0
        for t in sorted({3, case.tokens}):
            prob = make_problem(replace(case, tokens=t))
            ids = prob.ids.clone()
            ids[::3] = -1
            ids[1::4, 0] = -1
            prob = replace(prob, ids=ids)
            layer = self._layer(case)
            layer.load_weights(prob.weights.to(self.device))
            out = self._forward(case, layer, prob)  # on the device: _numeric checks where it is
            leaked = out[::3].float().abs().max().item()
            rows += out[::3].shape[0]
            if leaked != 0.0:
                problems.append(f"{t} tokens: padded tokens' rows are not zero (max |value| {leaked:.3g})")
                continue
            self._numeric(case, res, out, prob)
            if res.status != PASS:
                problems.append(f"{t} tokens: {res.detail}")
        res.status = FAIL if problems else PASS
        res.detail = "; ".join(problems) or f"{rows} padded rows zero; {res.detail}"

    def _check_double_process(self, case: Case, res: CaseResult) -> None:
        prob = make_problem(case)
        layer = self._layer(case)
        layer.load_weights(prob.weights.to(self.device), process=False)
        layer.process_weights_after_loading()
        try:
            layer.process_weights_after_loading()
        except WeightsAlreadyProcessedError:
            res.status, res.detail = PASS, "second process_weights_after_loading refused"
            return
        res.status, res.detail = FAIL, "a second weight processing was accepted"

    def _check_bad_input(self, case: Case, res: CaseResult) -> None:
        prob = make_problem(case)
        layer = self._layer(case, validate=True)
        layer.load_weights(prob.weights.to(self.device))
        d, cfg = self.device, case.config
        x, ids, w = prob.x.to(d), prob.ids.to(d), prob.wts.to(d)
        other = torch.float16 if cfg.dtype != torch.float16 else torch.bfloat16
        bad = {
            "wrong dtype": lambda: layer(x.to(other), ids, w),
            "wrong hidden size": lambda: layer(x[:, : cfg.hidden_size // 2], ids, w),
            "wrong top-k shape": lambda: layer(x, ids[:, :1], w[:, :1]) if cfg.top_k > 1 else layer(x, ids.t(), w),
            "expert id out of range": lambda: layer(x, ids + cfg.num_experts, w),
            "float ids": lambda: layer(x, ids.float(), w),
        }
        missed = []
        for name, call in bad.items():
            try:
                call()
                missed.append(f"{name}: accepted")
            except InputError:
                pass
            except MoEHalError as exc:
                missed.append(f"{name}: {type(exc).__name__} instead of InputError")
        res.status = FAIL if missed else PASS
        res.detail = "; ".join(missed) or f"{len(bad)} bad inputs raised InputError"

    def _honesty(self, case: Case, res: CaseResult) -> CaseResult:
        seen = {(d.name, d.reason) for d in case.decisions if not d.ok}
        empty = sorted(name for name, reason in seen if not reason or not reason.strip())
        res.status = FAIL if empty else PASS
        res.detail = (
            f"declines without a reason: {empty}" if empty else f"{len(seen)} distinct declines, each with a reason"
        )
        return res
