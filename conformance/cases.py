"""The conformance cases, computed from a backend's own declarations.

For every configuration below, `moehal.enumerate_pipelines` asks the backend which
pipelines it accepts. Accepted pipelines become cases that must pass; a configuration the
backend declines becomes a `declined` case carrying the backend's reason. Nothing is
skipped silently.

Families:
- matrix: every quant scheme x activation x every format the backend consumes.
- features: biases, routed scaling, router weight on input, EP local range, fp16/fp32,
  hidden sizes that are not multiples of 128.
- shapes: 0, 1 and odd token counts, all tokens to one expert, experts without tokens,
  top-k from 1 to 10, large and small expert counts.
- padding: masked and contiguous layouts keep padding rows zero (dispatchers that declare
  `zero_padding`); contiguous ones mark them -1; experts given NaN in the input's padding rows
  keep it out of live rows and leave zeros in their output's padding rows.
- routing: router logits in (fp32 and bf16), softmax and DeepSeek-V3 grouped routing.
- determinism, cuda_graph, side_stream, two_streams, inference_mode, out_buffer, strided_inputs,
  input_dtypes, row_isolation, kept_outputs:
  per claimed quant scheme, at the base shape and at the 512-wide one for paths it did not reach.
- padded_ids: -1 top-k ids (`MoEConfig.topk_padding`), per claimed quant scheme, paths as above;
  and at top-1 for the first claimed scheme, where a kernel may write output rows directly.
- tuned: the configurations where the backend's own implementations declare that they run
  other code than at the small shapes above (`Implementation.tuned_shapes`: tables of tuned
  tiles keyed by real model shapes), at the batch sizes they declare for each path.
- double_process, bad_input, honesty.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from moehal.config import MoEConfig
from moehal.errors import PluginCheckError
from moehal.interfaces import BuildRequest
from moehal.plugins import Registry
from moehal.quant import ALL_SCHEMES, QuantScheme
from moehal.routing import RoutingConfig
from moehal.selection import CandidateDecision, Pipeline, enumerate_pipelines

BASE = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
ACTIVATIONS: dict[str, dict[str, object]] = {
    "silu": dict(activation="silu"),
    "gelu": dict(activation="gelu"),
    "swiglu_oai": dict(activation="swiglu_oai"),
    "silu_nongated": dict(activation="silu", gated=False),
}
BF16 = QuantScheme.parse("bf16")
# The checks of how a forward behaves (streams, graphs, buffers, input layouts), run per claimed
# quant scheme; `double_process` and `bad_input` run once.
BEHAVIOUR_CHECKS = (
    "determinism",
    "cuda_graph",
    "side_stream",
    "two_streams",
    "inference_mode",
    "out_buffer",
    "strided_inputs",
    "input_dtypes",
    "row_isolation",
    "kept_outputs",
)


@dataclass(frozen=True)
class Case:
    """One conformance case. `pipeline` is None when the backend declined (`declined`)."""

    id: str
    family: str
    check: str  # numeric, padding, dispatch, determinism, cuda_graph, side_stream, two_streams, inference_mode,
    # out_buffer, strided_inputs, input_dtypes, row_isolation, kept_outputs, padded_ids, double_process,
    # bad_input, logits, honesty
    config: MoEConfig
    quant: QuantScheme
    tokens: int = 7
    pattern: str = "random"  # random | one_expert | few_experts | other_ranks
    pipeline: Pipeline | None = None
    declined: str | None = None
    seed: int = 0
    logits_dtype: torch.dtype = torch.float32
    decisions: tuple[CandidateDecision, ...] = field(default=(), compare=False)
    # a plugin's capability check raised for this config: the case fails with it (the other
    # cases still run, and the report names the config)
    error: str | None = None

    @property
    def layout(self) -> str:
        p = self.pipeline
        if p is None:
            return "-"
        return "fused" if p.kind == "fused" else (p.fmt.layout_name if p.fmt else "-")


def _short(p: Pipeline) -> str:
    if p.kind == "fused":
        return p.main.name
    small = f"+{p.small.fmt}<={p.small.max_tokens}" if p.small else ""
    return f"{p.main.name}[{p.fmt}]{small}"


def _distinct(pipes: list[Pipeline], per_layout: bool | None) -> list[Pipeline]:
    """All accepted pipelines of distinct (kernel, format), or the best one per layout, or
    (per_layout None) every distinct (dispatcher, kernel, format) pairing. A small-batch
    format makes a pairing distinct: with and without it are two paths to check."""
    seen: set[object] = set()
    out = []
    for p in pipes:
        if per_layout is None:
            key = (p.dispatcher.qualname if p.dispatcher else None, p.main.qualname, p.fmt, p.small)
        elif per_layout:
            key = ("fused", p.main.qualname) if p.kind == "fused" else (p.fmt.layout_name if p.fmt else None, p.small)
        else:
            key = (p.main.qualname, p.fmt, p.small)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


_DEPTH = {
    "request": -1,
    "hardware": 0,
    "libraries": 1,
    "quant": 2,
    "activation": 3,
    "parallel": 4,
    "shape": 5,
    "routing": 6,
    "padding_ids": 6,
    "weights": 7,
    "format": 8,
}


def _main_decline(decisions: list[CandidateDecision], backend: str) -> str:
    """The backend's reasons, the most telling first: a kernel that got as far as the shape
    check says more about this configuration than one for other hardware."""
    mine = [d for d in decisions if d.name.startswith(f"{backend}.") and not d.ok and d.kind in ("experts", "fused")]
    mine = mine or [d for d in decisions if d.name.startswith(f"{backend}.") and not d.ok]
    if not mine:
        return "the backend declares no experts kernel or fused forward"
    mine.sort(key=lambda d: -_DEPTH.get(d.predicate, 0))
    return "; ".join(f"{d.name}: {d.reason}" for d in mine)


class CaseBuilder:
    def __init__(self, backend: str, registry: Registry, req_template: BuildRequest, profile: str = "full") -> None:
        self.backend, self.registry, self.template, self.profile = backend, registry, req_template, profile

    def pipelines(self, config: MoEConfig, quant: QuantScheme) -> tuple[list[Pipeline], list[CandidateDecision]]:
        req = BuildRequest(config, quant, self.template.hardware, self.template.settings)
        pipes, decisions = enumerate_pipelines(req, self.registry, self.backend)
        return pipes, decisions

    def reaches(self, config: MoEConfig, quant: QuantScheme) -> bool:
        """Whether any pipeline of this backend takes `config` in `quant`. A check that raises
        counts as none here; the matrix family's cases report it."""
        try:
            return bool(self.pipelines(config, quant)[0])
        except PluginCheckError:
            return False

    def cases_for(
        self,
        family: str,
        check: str,
        name: str,
        config: MoEConfig,
        quant: QuantScheme,
        per_layout: bool | None = True,
        **kw: object,
    ) -> Iterator[Case]:
        try:
            pipes, decisions = self.pipelines(config, quant)
        except PluginCheckError as exc:
            yield Case(f"{family}/{quant.name}/{name}", family, check, config, quant, error=str(exc), **kw)  # type: ignore[arg-type]
            return
        if check == "padding":
            pipes = [
                p
                for p in pipes
                if p.kind == "modular" and p.fmt is not None and p.fmt.layout_name in ("masked", "contiguous")
            ]
            if not pipes:
                return
        if not pipes:
            yield Case(
                f"{family}/{quant.name}/{name}",
                family,
                check,
                config,
                quant,
                declined=_main_decline(decisions, self.backend),
                decisions=tuple(decisions),
                **kw,
            )  # type: ignore[arg-type]
            return
        for p in _distinct(pipes, per_layout):
            prefix = f"{p.dispatcher.qualname}->" if per_layout is None and p.dispatcher else ""
            yield Case(
                f"{family}/{quant.name}/{name}/{prefix}{_short(p)}",
                family,
                check,
                config,
                quant,
                pipeline=p,
                decisions=tuple(decisions),
                **kw,
            )  # type: ignore[arg-type]

    def behaviour_cases(self, check: str, base: MoEConfig, wide: MoEConfig, quant: QuantScheme) -> list[Case]:
        """`check`'s cases for `quant` at the base shape, then at the 512-wide one for the
        (kernel, layout, small-batch) paths the base shape did not reach; one `declined` case
        when neither shape has a pipeline."""
        return self.base_then_wide(check, check, ("base", "wide_512"), base, wide, quant, tokens=16)

    def base_then_wide(
        self,
        family: str,
        check: str,
        names: tuple[str, str],
        base: MoEConfig,
        wide: MoEConfig,
        quant: QuantScheme,
        **kw: object,
    ) -> list[Case]:
        """Cases at `base`, then at `wide` for the (kernel, layout, small-batch) paths `base` did
        not reach (kernels with minimum sizes, e.g. Ascend FuseEP, or DeepGEMM's FP8 GEMMs that
        want K in multiples of 128); one `declined` case when neither has a pipeline."""
        found: list[Case] = []
        seen: set[object] = set()
        declined: Case | None = None
        for name, cfg in zip(names, (base, wide)):
            for c in self.cases_for(family, check, name, cfg, quant, **kw):
                p = c.pipeline
                if p is None:
                    if c.error is not None:  # a raising check fails at either shape
                        found.append(c)
                    else:
                        declined = declined or c
                    continue
                key = _path_key(c)
                if key not in seen:
                    seen.add(key)
                    found.append(c)
        return found or ([declined] if declined else [])

    def tuned_cases(self) -> list[Case]:
        """The `tuned` family: for each implementation of this backend that declares tuned
        shapes on this hardware, every declared batch size through the pipeline a layer builds
        for that implementation at that shape (its first, as selection ranks them: what a
        benchmark of the shape times). A declared shape the implementation then declines is a
        failure: it claimed to run there."""
        cases: list[Case] = []
        impls = [i for i in (*self.registry.experts, *self.registry.fused) if i.backend == self.backend]
        req = BuildRequest(MoEConfig(**BASE), BF16, self.template.hardware, self.template.settings)  # type: ignore[arg-type]
        for impl in impls:
            try:
                shapes = list(impl.tuned_shapes(req))
            except Exception as exc:  # noqa: BLE001 - a plugin bug: a failing case that names it
                why = f"{impl.qualname}.tuned_shapes raised {type(exc).__name__}: {exc}".splitlines()[0][:300]
                cases.append(Case(f"tuned/{impl.name}/declaration", "tuned", "numeric", req.config, BF16, declined=why))
                continue
            for ts in shapes:
                pipes = [p for p in self.pipelines(ts.config, ts.quant)[0] if p.main.qualname == impl.qualname]
                p = pipes[0] if pipes else None
                reason = None if p else f"{impl.qualname} declares {ts.name} ({ts.why}) but builds no pipeline for it"
                for t in ts.tokens:
                    suffix = f"/{_short(p)}" if p is not None else ""
                    case_id = f"tuned/{ts.quant.name}/{ts.name}/{impl.name}_tokens_{t}{suffix}"
                    cases.append(
                        Case(case_id, "tuned", "numeric", ts.config, ts.quant, tokens=t, pipeline=p, declined=reason)
                    )
        return cases

    def all_cases(self) -> list[Case]:
        cases: list[Case] = []
        base = MoEConfig(**BASE)  # type: ignore[arg-type]
        # Fused kernels (e.g. Ascend FuseEP) have minimum sizes: this shape reaches them.
        wide_512: dict[str, object] = dict(hidden_size=512, intermediate_size=512, max_tokens=16)
        wide = base.with_(**wide_512)
        claimed: list[QuantScheme] = []
        # matrix ------------------------------------------------------------------------------
        for quant in ALL_SCHEMES:
            any_ok = False
            for act_name, act in ACTIVATIONS.items():
                for c in self.cases_for("matrix", "numeric", act_name, base.with_(**act), quant, per_layout=False):
                    any_ok |= c.pipeline is not None
                    cases.append(c)
            if any_ok:
                claimed.append(quant)
        # A scheme whose kernels all decline the base shape (a fused kernel's minimum size) is
        # claimed where the wide one has a pipeline: its families run there, and wide_512 passes.
        claimed += [q for q in ALL_SCHEMES if q not in claimed and self.reaches(wide, q)]
        first = claimed[0] if claimed else BF16  # a scheme the base shape takes, where there is one
        # features ----------------------------------------------------------------------------
        features: dict[str, dict[str, object]] = {
            "biases": dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True),
            "routed_scaling": dict(routed_scaling_factor=2.5),
            "weight_on_input": dict(top_k=1, apply_router_weight_on_input=True),
            "ep_local_range": dict(ep_size=2, ep_rank=1),
            "hidden_not_128x": dict(hidden_size=192, intermediate_size=96),
            "wide_512": wide_512,
            # SwiGLU-OAI's clamps within reach of the data (at the default limit of 7, randn
            # weights and inputs never reach them: session 45's audit dropped both, unseen)
            "swiglu_clamp": dict(activation="swiglu_oai", swiglu_limit=1.0),
        }
        for quant in claimed:
            for name, change in features.items():
                if name in ("wide_512", "hidden_not_128x"):  # shapes of their own
                    cases.extend(self.cases_for("features", "numeric", name, base.with_(**change), quant))
                    continue
                # and at the wide shape for the paths the base shape does not reach: session 45's
                # audit found FuseEP's routed scaling never run (both fuse modes decline the base)
                names = (name, f"{name}_512")
                cases.extend(
                    self.base_then_wide("features", "numeric", names, base.with_(**change), wide.with_(**change), quant)
                )
        for dtype_name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
            cases.extend(self.cases_for("features", "numeric", dtype_name, base.with_(dtype=dtype), BF16))
        # shapes ------------------------------------------------------------------------------
        shapes: list[tuple[str, dict[str, object], dict[str, object]]] = [
            ("tokens_0", {}, dict(tokens=0)),
            ("tokens_1", {}, dict(tokens=1)),
            ("tokens_33", {}, dict(tokens=33)),
            ("one_expert", dict(top_k=1), dict(tokens=9, pattern="one_expert")),
            ("idle_experts", dict(num_experts=16), dict(tokens=3, pattern="few_experts")),
            # An expert-parallel rank whose batch has tokens but no slot for its experts: a
            # grouped layout with rows and no segments (the output is all zeros).
            ("no_local_slots", dict(ep_size=2, ep_rank=1), dict(tokens=9, pattern="other_ranks")),
            ("top_k_1", dict(num_experts=16, top_k=1), {}),
            ("top_k_4", dict(num_experts=16, top_k=4), {}),
            ("top_k_8", dict(num_experts=16, top_k=8), {}),
            ("top_k_10", dict(num_experts=16, top_k=10), {}),
            ("experts_2", dict(num_experts=2, top_k=1), {}),
            ("experts_64", dict(num_experts=64, top_k=6), dict(tokens=5)),
            # not a power of two (Qwen1.5-MoE's 60 experts, top-4): kernels that pad expert
            # tables to a power of two, or assume one, show here and at no other count above
            ("experts_60", dict(num_experts=60, top_k=4), dict(tokens=7)),
        ]
        if self.profile == "quick":
            quick = {"tokens_0", "tokens_1", "one_expert", "no_local_slots", "top_k_10", "experts_64", "experts_60"}
            shapes = [s for s in shapes if s[0] in quick]
        for name, change, kw in shapes:
            # at the base shape in the first scheme; then, at the wide shape in every claimed
            # scheme, the paths no case of this shape reached: a fused forward with minimum
            # sizes and a scheme of its own (FuseEP, int8) was otherwise `verified` without any
            tokens = kw.get("tokens", 0)
            roomy = dict(max_tokens=tokens) if isinstance(tokens, int) and tokens > 16 else {}
            found = list(self.cases_for("shapes", "numeric", name, base.with_(**change), first, **kw))
            seen = {_path_key(c) for c in found if c.pipeline is not None}
            for quant in claimed:
                for c in self.cases_for("shapes", "numeric", f"{name}_512", wide.with_(**change, **roomy), quant, **kw):
                    if c.error is not None:
                        found.append(c)
                    elif c.pipeline is not None and _path_key(c) not in seen:
                        seen.add(_path_key(c))
                        found.append(c)
            cases.extend(found)
        # every dispatcher the experts can be paired with (a dispatcher that ignores a format's
        # row alignment, say, shows here and not with the best dispatcher alone) ------------
        for quant in claimed[:2]:
            cases.extend(self.cases_for("pairs", "dispatch", "silu", base, quant, per_layout=None, tokens=9))
        # padding rows ------------------------------------------------------------------------
        for quant in claimed:
            # With biases, computing a padding row would make it non-zero; backends without
            # bias support are checked without (then only leaks into the output show). Experts
            # that decline the base shape (DeepGEMM's FP8 GEMMs want K in multiples of 128) are
            # checked at the wide one. Each (kernel, layout) at the first config that reaches it:
            # a layout whose experts take no biases is still checked when another's do.
            covered: set[tuple[str, str]] = set()
            for name, cfg in (
                ("bias_rows", base.with_(has_w13_bias=True, has_w2_bias=True, top_k=1)),
                ("plain_rows", base.with_(top_k=1)),
                ("bias_rows_512", wide.with_(has_w13_bias=True, has_w2_bias=True, top_k=1)),
                ("plain_rows_512", wide.with_(top_k=1)),
            ):
                found = [
                    c
                    for c in self.cases_for("padding", "padding", name, cfg, quant, tokens=5)
                    if (c.pipeline.main.qualname, c.layout) not in covered  # type: ignore[union-attr]
                ]
                covered |= {(c.pipeline.main.qualname, c.layout) for c in found}  # type: ignore[union-attr]
                cases.extend(found)
        # routing inside the layer --------------------------------------------------------------
        routings = {
            "softmax": RoutingConfig("softmax"),
            "deepseek_v3": RoutingConfig("deepseek_v3", n_group=4, topk_group=2, has_correction_bias=True),
            # Llama-4: top-1 on the logits, the token scaled by sigmoid(top logit) on the input
            "sigmoid": RoutingConfig("sigmoid", renormalize=False),
        }
        top_ks = {"deepseek_v3": 4, "sigmoid": 1}
        for name, routing in routings.items():
            change: dict[str, object] = dict(routing=routing, top_k=top_ks.get(name, 2))
            if name == "sigmoid":
                change["apply_router_weight_on_input"] = True
            for quant in claimed[:2] or [BF16]:
                for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                    names = (f"{name}_{dt_name}_logits", f"{name}_{dt_name}_logits_512")
                    cases.extend(
                        self.base_then_wide(
                            "routing",
                            "logits",
                            names,
                            base.with_(**change),
                            wide.with_(**change),
                            quant,
                            logits_dtype=dt,
                        )
                    )
        # behaviour ---------------------------------------------------------------------------
        # Per claimed quant scheme: each scheme has its own kernels (quantizers, scale layouts,
        # FP8 GEMMs), and any of them may launch off the caller's stream or refuse capture.
        for quant in claimed or [BF16]:
            for check in BEHAVIOUR_CHECKS:
                cases.extend(self.behaviour_cases(check, base, wide, quant))
            # rows whose width is no multiple of a K tile: a K tail read past the row shows
            tail = base.with_(**features["hidden_not_128x"])
            cases.extend(self.cases_for("strided_inputs", "strided_inputs", "hidden_not_128x", tail, quant, tokens=16))
        # -1 ids: only pipelines whose dispatcher (or fused forward) declares dropping them are
        # built for MoEConfig.topk_padding; a backend with none shows one declined case ----------
        for quant in claimed or [BF16]:
            padded = dict(topk_padding=True)
            cases.extend(self.behaviour_cases("padded_ids", base.with_(**padded), wide.with_(**padded), quant))
        # top-1 on one device: the portable Triton kernel's GEMM2 wrote output rows itself there,
        # and left padded tokens' rows as the buffer held them (found in session 40's audit)
        cases.extend(
            self.cases_for("padded_ids", "padded_ids", "top1", base.with_(top_k=1, topk_padding=True), first, tokens=16)
        )
        cases.extend(self.tuned_cases())
        for check in ("double_process", "bad_input"):
            cases.extend(self.cases_for(check, check, "base", base, first, tokens=16))
        cases.append(
            Case(
                "honesty/declines_have_reasons",
                "honesty",
                "honesty",
                base,
                first,
                decisions=tuple(d for c in cases for d in c.decisions),
            )
        )
        return cases


def _path_key(case: Case) -> tuple[str, str | None, bool]:
    """The code path a case runs: its kernel, layout, and whether a small-batch path serves it."""
    p = case.pipeline
    assert p is not None  # (callers pass cases with a pipeline)
    return (p.main.qualname, case.layout, p.small is not None)
