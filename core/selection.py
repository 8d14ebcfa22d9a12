"""Selection, once, at layer build: negotiate formats and pick the best pipeline.

For every experts kernel that accepts the configuration, each input format it consumes is
offered to every dispatcher; a dispatcher that can produce exactly that format is paired
with it. If none can, but one can produce the same layout unquantized, a quantize adapter
is inserted between them. Fused forwards compete with these pairs. The winner is the
highest priority (experts or fused priority, then dispatcher priority, then fewer adapters,
then the experts' own format preference, then the name: never install order).

Every candidate that declined is kept with its reason: `NoBackendError` and
`moehal explain` print them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moehal.capability import Decision
from moehal.config import MoEConfig
from moehal.errors import MoEHalError, NoBackendError, PluginCheckError
from moehal.formats import ActivationFormat, ScaleKind, SmallBatchFormat
from moehal.hardware import HardwareInfo
from moehal.interfaces import (
    BuildRequest,
    Dispatcher,
    Experts,
    FusedForward,
    Implementation,
    WeightProcessor,
)
from moehal.plugins import Registry
from moehal.quant import QuantScheme
from moehal.quant.activation import quantize_activation, scale_kind_dtype
from moehal.settings import Settings

_T = TypeVar("_T")


@dataclass(frozen=True)
class CandidateDecision:
    """One row of the decision table."""

    name: str
    kind: str  # 'experts', 'fused', 'dispatcher', 'pipeline'
    ok: bool
    reason: str
    predicate: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class QuantizeAdapter:
    """Quantizes a dispatched layout in place of a dispatcher that only moves unquantized
    rows (e.g. an all-to-all that sends BF16): the experts still get exactly their format."""

    name = "quantize"

    @staticmethod
    def source_format(target: ActivationFormat, dtype: Any) -> ActivationFormat | None:
        """The unquantized format to dispatch for `target`, or None where the adapter cannot make
        `target` exactly: the reference quantizers emit fp8 e4m3fn (group and static scales) and
        int8 (per token) only, so experts that want e.g. e4m3fnuz get no adapter."""
        if not target.is_quantized or scale_kind_dtype(target.scales) != target.dtype:
            return None
        return target.unquantized(dtype)

    def __init__(self, target: ActivationFormat) -> None:
        self.target = target
        self.static_scale: Any = None  # STATIC_TENSOR: the weights' a13_scale (`load_input_scale`)

    def load_input_scale(self, scale: Any) -> None:
        self.static_scale = scale

    def __call__(self, inp: Any) -> Any:
        q, s = quantize_activation(inp.hidden, self.target.scales, self.static_scale)
        return dataclasses.replace(inp, hidden=q, scales=s)


@dataclass(frozen=True)
class Pipeline:
    """An accepted, buildable candidate: a modular (dispatcher, [adapter], experts) chain or a
    fused forward, plus the weight processor its kernel needs (None for canonical weights)."""

    kind: str  # 'modular' or 'fused'
    experts: Experts | None = None
    dispatcher: Dispatcher | None = None
    fmt: ActivationFormat | None = None  # what the experts consume
    dispatch_fmt: ActivationFormat | None = None  # what the dispatcher produces
    fused: FusedForward | None = None
    processor: WeightProcessor | None = None
    routes_internally: bool = False
    small: SmallBatchFormat | None = None  # the experts' small-batch format, when the dispatcher makes it
    rank: tuple[Any, ...] = field(default=(), compare=False)

    @property
    def main(self) -> Implementation:
        impl = self.fused if self.kind == "fused" else self.experts
        assert impl is not None
        return impl

    @property
    def adapter(self) -> str | None:
        return QuantizeAdapter.name if self.dispatch_fmt != self.fmt and self.kind == "modular" else None

    def execution_mode(self, req: BuildRequest) -> str:
        """'emulated' if any part is, else 'interpreted' if any part is, else 'native'."""
        modes = {_mode(p, req) for p in (self.main, self.dispatcher, self.processor) if p is not None}
        for mode in ("emulated", "interpreted"):
            if mode in modes:
                return mode
        return "native"

    @property
    def graph_capturable(self) -> bool:
        parts = [p for p in (self.main, self.dispatcher) if p is not None]
        return all(p.graph_capturable for p in parts)

    @property
    def deterministic(self) -> bool:
        parts = [p for p in (self.main, self.dispatcher) if p is not None]
        return all(p.deterministic for p in parts)

    @property
    def name(self) -> str:
        if self.kind == "fused":
            return f"fused {self.main.qualname}"
        assert self.dispatcher is not None
        adapter = f" -> {self.adapter}" if self.adapter else ""
        small = f" + [{self.small}]" if self.small else ""
        return f"{self.dispatcher.qualname}{adapter} -> {self.main.qualname} [{self.fmt}]{small}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "experts": self.experts.qualname if self.experts else None,
            "dispatcher": self.dispatcher.qualname if self.dispatcher else None,
            "fused": self.fused.qualname if self.fused else None,
            "format": str(self.fmt) if self.fmt else None,
            "dispatch_format": str(self.dispatch_fmt) if self.dispatch_fmt else None,
            "small_batch_format": str(self.small.fmt) if self.small else None,
            "small_batch_max_tokens": self.small.max_tokens if self.small else None,
            "small_batch_prefill_min_tokens": self.small.prefill_min_tokens if self.small else None,
            "small_batch_prefill_max_tokens": self.small.prefill_max_tokens if self.small else None,
            "adapter": self.adapter,
            "weight_processor": self.processor.qualname if self.processor else None,
            "weight_layout": self.main.weight_layout,  # type: ignore[attr-defined]
            "routes_internally": self.routes_internally,
            "graph_capturable": self.graph_capturable,
            "fallback": self.main.fallback,  # type: ignore[attr-defined]
        }


@dataclass(frozen=True)
class Plan:
    """The result of selection: the chosen pipeline, the alternatives, and every decline."""

    request: BuildRequest
    pipeline: Pipeline
    alternatives: tuple[Pipeline, ...]
    decisions: tuple[CandidateDecision, ...]

    def __str__(self) -> str:
        p, r = self.pipeline, self.request
        lines = [
            f"moehal plan: {r.config.describe()} | quant {r.quant.name} | {r.hardware.describe()}",
            f"  pipeline     {p.kind}: {p.name}",
        ]
        if p.kind == "modular":
            lines.append(f"  dispatch     {p.dispatcher.qualname if p.dispatcher else '-'} produces {p.dispatch_fmt}")
            if p.adapter:
                lines.append(f"  adapter      {p.adapter}: {p.dispatch_fmt} -> {p.fmt}")
            lines.append(f"  experts      {p.main.qualname} consumes {p.fmt}")
            if p.small and p.small.max_tokens > 0:  # (0: a band of batch sizes only, below)
                why = f" ({p.small.why})" if p.small.why else ""
                lines.append(f"  small batch  at <= {p.small.max_tokens} tokens: {p.small.fmt}{why}")
            if p.small:
                if p.small.prefill_min_tokens is not None:
                    why = f" ({p.small.prefill_why})" if p.small.prefill_why else ""
                    lines.append(f"  band         at {p.small.prefill_range} tokens: {p.small.fmt}{why}")
        layout = p.main.weight_layout  # type: ignore[attr-defined]
        proc = f"{layout} via {p.processor.qualname}" if p.processor else f"{layout} (no processing)"
        lines.append(f"  weights      {proc}")
        lines.append(
            f"  routing      {'inside the kernel' if p.routes_internally else 'by the caller or moehal.route'}"
        )
        mode = p.execution_mode(r)
        capturable = p.graph_capturable and mode != "interpreted"  # an interpreter runs on the host
        lines.append(f"  graphs       {'capturable' if capturable else 'not capturable'}")
        if mode == "emulated":
            lines.append("  mode         EMULATED: vendor ops run as torch stand-ins (explicitly enabled)")
        elif mode == "interpreted":
            lines.append("  mode         INTERPRETED: kernel code runs under an interpreter (e.g. TRITON_INTERPRET=1)")
        if p.main.fallback:  # type: ignore[attr-defined]
            lines.append(
                f"  note         the slow {p.main.backend} fallback ({p.main.qualname}) was chosen; `moehal explain` "
                "shows why others declined"
            )
        lines.append(
            f"  alternatives {len(self.alternatives)} accepted, {sum(not d.ok for d in self.decisions)} declined"
        )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.request.config.describe(),
            "quant": self.request.quant.name,
            "hardware": self.request.hardware.describe(),
            "pipeline": {**self.pipeline.as_dict(), "mode": self.pipeline.execution_mode(self.request)},
            "alternatives": [a.as_dict() for a in self.alternatives],
            "decisions": [d.as_dict() for d in self.decisions],
        }


def _processor_for(
    layout: str, req: BuildRequest, processors: Iterable[WeightProcessor], backend: str
) -> tuple[WeightProcessor | None, Decision]:
    """The processor that prepares `layout` for a kernel of `backend`: its own backend's
    first, by priority, then another backend's of the same layout name (in-tree, the CUDA and
    ROCm Triton kernels share theirs). Layout names are not namespaced, so a plugin's
    processor that happens to name another backend's layout never outranks that backend's
    own processor, whatever its priority."""
    if layout == "canonical":
        return None, Decision(True, "canonical weights", "weights")
    reasons = []
    for p in sorted(processors, key=lambda p: (p.backend != backend, -p.priority, p.qualname)):
        if p.layout != layout:
            continue
        d = _decision(p, "a capability check", p.supports, req)
        if d.ok:
            return p, d
        reasons.append(f"{p.qualname}: {d.reason}")
    why = "; ".join(reasons) or "none registered"
    return None, Decision(False, f"no weight processor for layout {layout!r} ({why})", "weights")


def _ask(
    impl: Implementation,
    what: str,
    call: Callable[..., _T],
    *args: Any,
    returns: type | tuple[type, ...] = object,
    expected: str = "",
) -> _T:
    """`call(*args)`, a plugin's answer about `impl`; a plugin that raises instead of answering,
    or answers something other than an instance of `returns` (described as `expected`), gets
    `PluginCheckError` naming it (as `Implementation.supports` does for its predicates)."""
    try:
        answer = call(*args)
    except MoEHalError:
        raise
    except Exception as exc:
        raise PluginCheckError.raised(impl.qualname, impl.backend, what, exc) from exc
    if not isinstance(answer, returns):
        raise PluginCheckError.answered(impl.qualname, impl.backend, what, answer, expected)
    return answer


def _decision(impl: Implementation, what: str, call: Callable[..., Decision], *args: Any) -> Decision:
    """A plugin's `Decision` (`supports`, `can_produce`), checked to be one."""
    return _ask(impl, what, call, *args, returns=Decision, expected="a Decision")


_MODES = ("native", "emulated", "interpreted")


def _mode(impl: Implementation, req: BuildRequest) -> str:
    """`impl.execution_mode(req)`, checked to be one of the modes selection knows."""
    mode = _ask(impl, "execution_mode", impl.execution_mode, req, returns=str, expected=f"one of {_MODES}")
    if mode not in _MODES:
        raise PluginCheckError.answered(impl.qualname, impl.backend, "execution_mode", mode, f"one of {_MODES}")
    return mode


def _input_formats(experts: Experts, req: BuildRequest) -> list[ActivationFormat]:
    """`experts.input_formats(req)`, checked to be a list or tuple of `ActivationFormat`."""
    want = "a list of ActivationFormat"
    offered = _ask(experts, "input_formats", experts.input_formats, req, returns=(list, tuple), expected=want)
    if not all(isinstance(f, ActivationFormat) for f in offered):
        raise PluginCheckError.answered(experts.qualname, experts.backend, "input_formats", offered, want)
    return list(offered)


def _small_batch(
    experts: Experts,
    disp: Dispatcher,
    req: BuildRequest,
    decisions: list[CandidateDecision],
    layout: str | None,
    main: ActivationFormat,
) -> SmallBatchFormat | None:
    """The experts' small-batch format if this dispatcher produces it exactly (no adapter:
    its point is fewer launches), recording a refusal. A requested layout rules out others.
    Under expert parallelism across processes, each rank picks the format from its own token
    count, so ranks with other batch sizes dispatch in two formats into one collective: the
    small format is kept only where that sends the same rows (`same_wire_for_every_layout`,
    and the main format's dtype and scales)."""
    small = _ask(
        experts,
        "small_batch_format",
        experts.small_batch_format,
        req,
        returns=(SmallBatchFormat, type(None)),
        expected="a SmallBatchFormat or None",
    )
    if small is None or (layout is not None and small.fmt.layout_name != layout):
        return None
    name = f"{experts.qualname} [{small}]"
    if req.process_group is not None and req.config.ep_size > 1:
        same = disp.same_wire_for_every_layout and (small.fmt.dtype, small.fmt.scales) == (main.dtype, main.scales)
        if not same:
            why = (
                f"{disp.qualname}: under expert parallelism each rank picks the small-batch format from its own "
                f"token count, and {small.fmt} would not send the rows {main} sends (ranks would meet two formats "
                "in one collective)"
            )
            decisions.append(CandidateDecision(name, "pipeline", False, why, "parallel"))
            return None
    cp = _decision(disp, "can_produce", disp.can_produce, small.fmt, req)
    if not cp.ok:
        decisions.append(CandidateDecision(name, "pipeline", False, f"{disp.qualname}: {cp.reason}", "format"))
        return None
    return small


def enumerate_pipelines(
    req: BuildRequest,
    registry: Registry,
    backend: str | None = None,
    layout: str | None = None,
) -> tuple[list[Pipeline], list[CandidateDecision]]:
    """Every accepted pipeline, best first, and every decision taken on the way.

    backend: only experts/fused forwards of this backend (dispatchers may come from any).
    layout: only experts input formats of this layout (and no fused forwards).
    """
    decisions: list[CandidateDecision] = []
    pipelines: list[Pipeline] = []

    dispatchers: list[tuple[Dispatcher, Decision]] = []
    for disp in sorted(registry.dispatchers, key=lambda d: (-d.priority, d.qualname)):
        d = _decision(disp, "a capability check", disp.supports, req)
        dispatchers.append((disp, d))
        decisions.append(CandidateDecision(disp.qualname, "dispatcher", d.ok, d.reason, d.predicate))
    usable = [disp for disp, d in dispatchers if d.ok]

    def skip(impl: Implementation) -> str | None:
        if backend is not None and impl.backend != backend:
            return f"not of the requested backend {backend!r}"
        return None

    for fused in sorted(registry.fused, key=lambda f: (-f.priority, f.qualname)):
        why = skip(fused) or ("a layout was requested; fused forwards have none" if layout else None)
        if why:
            decisions.append(CandidateDecision(fused.qualname, "fused", False, why, "request"))
            continue
        d = _decision(fused, "a capability check", fused.supports, req)
        proc = None
        if d.ok:
            proc, pd = _processor_for(fused.weight_layout, req, registry.processors, fused.backend)
            d = d if pd.ok else pd
        decisions.append(CandidateDecision(fused.qualname, "fused", d.ok, d.reason, d.predicate))
        if d.ok:
            pipelines.append(
                Pipeline(
                    "fused",
                    fused=fused,
                    processor=proc,
                    routes_internally=_ask(
                        fused, "routes_internally", fused.routes_internally, req, returns=bool, expected="a bool"
                    ),
                    rank=(-fused.priority, 0, 0, 0, fused.qualname, 0),
                )
            )

    for experts in sorted(registry.experts, key=lambda e: (-e.priority, e.qualname)):
        why = skip(experts)
        if why:
            decisions.append(CandidateDecision(experts.qualname, "experts", False, why, "request"))
            continue
        d = _decision(experts, "a capability check", experts.supports, req)
        proc = None
        if d.ok:
            proc, pd = _processor_for(experts.weight_layout, req, registry.processors, experts.backend)
            d = d if pd.ok else pd
        decisions.append(CandidateDecision(experts.qualname, "experts", d.ok, d.reason, d.predicate))
        if not d.ok:
            continue
        offered = _input_formats(experts, req)
        formats = [f for f in offered if layout is None or f.layout_name == layout]
        if not formats:
            its = ", ".join(sorted({f.layout_name for f in offered}))
            why = f"consumes no {layout!r} format here (its layouts: {its})"
            decisions.append(CandidateDecision(experts.qualname, "experts", False, why, "format"))
        for pref, fmt in enumerate(formats):
            found = False
            refusals = []
            for disp in usable:
                cp = _decision(disp, "can_produce", disp.can_produce, fmt, req)
                src = fmt
                adapters = 0
                if not cp.ok:
                    alt = QuantizeAdapter.source_format(fmt, req.config.dtype)
                    if (
                        alt is not None
                        and fmt.scales is not ScaleKind.NONE
                        and _decision(disp, "can_produce", disp.can_produce, alt, req).ok
                    ):
                        src, adapters, cp = alt, 1, Decision(True, "via quantize adapter", "format")
                if cp.ok:
                    found = True
                    small = _small_batch(experts, disp, req, decisions, layout, src) if not adapters else None
                    rank = (-experts.priority, -disp.priority, adapters, pref, experts.qualname)
                    pipe = Pipeline(
                        "modular",
                        experts=experts,
                        dispatcher=disp,
                        fmt=fmt,
                        dispatch_fmt=src,
                        processor=proc,
                        small=small,
                        rank=(*rank, 0),
                    )
                    pipelines.append(pipe)
                    if small is not None:  # the main format at every size: conformance runs both
                        pipelines.append(dataclasses.replace(pipe, small=None, rank=(*rank, 1)))
                else:
                    refusals.append(f"{disp.qualname}: {cp.reason}")
            name = f"{experts.qualname} [{fmt}]"
            if found:
                decisions.append(
                    CandidateDecision(name, "pipeline", True, "a dispatcher produces this format", "format")
                )
            else:
                why = "; ".join(refusals) or "no usable dispatcher"
                decisions.append(
                    CandidateDecision(name, "pipeline", False, f"no dispatcher produces it ({why})", "format")
                )

    # An interpreter (TRITON_INTERPRET=1) is for tests: a part that would run interpreted is
    # used only when its own backend is the one requested by name.
    kept = []
    for p in pipelines:
        parts = [x for x in (p.main, p.dispatcher, p.processor) if x is not None]
        bad = [x.qualname for x in parts if _mode(x, req) == "interpreted" and x.backend != backend]
        if bad:
            decisions.append(
                CandidateDecision(
                    p.name,
                    "pipeline",
                    False,
                    f"{', '.join(bad)} would run interpreted; interpreters are used only when their backend is named",
                    "request",
                )
            )
        else:
            kept.append(p)
    pipelines = kept
    pipelines.sort(key=lambda p: p.rank)
    return pipelines, decisions


def select(
    req: BuildRequest,
    registry: Registry,
    backend: str | None = None,
    layout: str | None = None,
) -> Plan:
    """Choose the best pipeline or raise `NoBackendError` listing every decline."""
    if backend is not None:
        registry.check_backend(backend)
    pipelines, decisions = enumerate_pipelines(req, registry, backend, layout)
    if not pipelines:
        what = f"backend {backend!r}" if backend else "any installed backend"
        lay = f", layout {layout!r}" if layout else ""
        failed = sorted({r.name for r in registry.failed()})
        broken = f" Plugins that failed to load (see `moehal doctor`): {', '.join(failed)}." if failed else ""
        raise NoBackendError(
            f"No MoE pipeline of {what} supports {req.config.describe()} with quant {req.quant.name}"
            f"{lay} on {req.hardware.describe()}.{broken}",
            [d for d in decisions if d.kind != "pipeline" or not d.ok],
        )
    return Plan(req, pipelines[0], tuple(pipelines[1:]), tuple(decisions))


# A small config for the machine-level question below: hardware and library checks do not look
# at sizes, and a config is needed only to form a request.
_PROBE_CONFIG = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)


def machine_decision(impl: Implementation, hardware: HardwareInfo, settings: Settings | None = None) -> Decision:
    """Whether `impl` can run on this machine at all: its hardware check, then its library
    check (`moehal doctor`'s question). Checks that depend on the layer (quant scheme,
    activation, parallelism, shape) are `moehal explain`'s, for a given config."""
    quant = min(impl.quant_schemes, key=lambda q: q.name) if impl.quant_schemes else QuantScheme.parse("bf16")
    req = BuildRequest(MoEConfig(**_PROBE_CONFIG), quant, hardware, settings or Settings())  # type: ignore[arg-type]
    try:
        for check in (impl.check_hardware, impl.check_libraries):
            d = check(req)
            if not d.ok:
                return d
    except Exception as exc:  # noqa: BLE001 - a plugin's check that raises is itself the answer
        return Decision(False, f"its capability check raised {type(exc).__name__}: {exc}", "hardware")
    return Decision(True, "its hardware and library checks pass here", "libraries")
