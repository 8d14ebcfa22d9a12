"""`MoELayer`: the one object an engine holds per MoE layer.

Selection happens in the constructor; `forward` calls plain bound runners (no plugin lookup,
no search, and no host sync unless input validation with value checks is on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import sys
import threading
from typing import Any, Literal

import torch
from moehal import stream_order
from moehal.config import MoEConfig
from moehal.ep_dispatcher import check_process_group, check_ranks_agree
from moehal.errors import (
    ConfigError,
    ContractError,
    FallbackWarning,
    InferenceOnlyWarning,
    InputError,
    NotSupportedError,
    WeightError,
    WeightsAlreadyProcessedError,
    WeightsNotLoadedError,
    warn,
)
from moehal.formats import ContiguousInput, Layout, MaskedInput, ScaleKind, with_dirty_padding
from moehal.graphs import GraphCache, should_replay
from moehal.hardware import HardwareInfo, as_device, detect
from moehal.integrations import custom_op
from moehal.interfaces import BuildRequest, DispatchRunner, ExpertsRunner, FusedRunner
from moehal.plugins import Registry, discover
from moehal.quant import QuantScheme
from moehal.routing import TopK, route
from moehal.selection import Pipeline, Plan, QuantizeAdapter, enumerate_pipelines, select
from moehal.stream_order import StreamOrder
from moehal.weights import ExpertWeights, validate

_log = logging.getLogger(__name__)
# Plans logged so far, by what makes them differ: a model's 48-61 identical layers log one line.
_LOGGED_PLANS: set[tuple[Any, ...]] = set()
_LOGGED_LOCK = threading.Lock()


def _explain_command(c: MoEConfig, quant: QuantScheme) -> str:
    """The `moehal explain` line for this layer's configuration (its defaults are another model's)."""
    dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    args = [
        f"-E {c.num_experts}",
        f"-k {c.top_k}",
        f"--hidden {c.hidden_size}",
        f"--intermediate {c.intermediate_size}",
        f"--quant {quant.name}",
        f"--activation {c.activation.value}",
        f"--dtype {dtypes.get(c.dtype, 'bf16')}",
    ]
    flags = (
        (not c.gated, "--non-gated"),
        (c.has_w13_bias, "--w13-bias"),
        (c.has_w2_bias, "--w2-bias"),
        (c.apply_router_weight_on_input, "--router-weight-on-input"),
        (c.topk_padding, "--topk-padding"),
    )
    args += [flag for on, flag in flags if on]
    if c.ep_size > 1:
        args.append(f"--ep-size {c.ep_size} --ep-rank {c.ep_rank}")
    if c.max_tokens is not None:
        args.append(f"--max-tokens {c.max_tokens}")
    return "moehal explain " + " ".join(args)


def _log_plan(plan: Plan, hw: HardwareInfo) -> None:
    """The plan a layer got, once per distinct (config, quant, device, pipeline, mode): INFO,
    WARNING where kernels do not run natively (interpreted or emulated: a test mode that would
    leak into serving unseen otherwise); DEBUG lines for each better-ranked candidate that declined."""
    mode = plan.pipeline.execution_mode(plan.request)
    key = (plan.request.config, plan.request.quant, str(hw.device), hw.name, plan.pipeline.name, mode)
    with _LOGGED_LOCK:
        if key in _LOGGED_PLANS:
            return
        _LOGGED_PLANS.add(key)
    level = logging.INFO if mode == "native" else logging.WARNING
    if _log.isEnabledFor(level):
        c = plan.request.config
        _log.log(level, "moehal plan for %s, %s on %s: %s (%s)", c.describe(), plan.request.quant, hw.describe(),
                 plan.pipeline.name, mode)  # fmt: skip
    if _log.isEnabledFor(logging.DEBUG):
        for d in plan.decisions:
            if not d.ok:
                _log.debug("  declined: %s %s [%s]: %s", d.kind, d.name, d.predicate, d.reason)


_ID_DTYPES = frozenset({torch.int32, torch.int64})


def _accepted(pipeline: Pipeline, req: BuildRequest, registry: Registry, layout: str | None) -> Pipeline:
    """`pipeline` as selection accepts it for this request (it may have been enumerated for
    another config, quant scheme or device), else ConfigError with the declines."""
    pipes, decisions = enumerate_pipelines(req, registry, pipeline.main.backend, layout)
    for p in pipes:  # the same components and formats, with this request's weight processor
        if p.name == pipeline.name:
            return p
    parts = {x.qualname for x in (pipeline.main, pipeline.dispatcher, pipeline.processor) if x is not None}
    why = [f"{d.name}: {d.reason}" for d in decisions if not d.ok and d.name in parts] or ["no decline recorded"]
    raise ConfigError(
        f"pipeline {pipeline.name} is not accepted for {req.config.describe()} | quant {req.quant.name} | "
        f"{req.hardware.describe()}: " + "; ".join(why)
    )


def _wire(p: Pipeline) -> dict[str, str]:
    """What a pipeline sends between ranks: its dispatcher (or fused forward) and the format it
    dispatches in (`ep_dispatcher.check_ranks_agree`). The experts kernel may differ, and so may
    a small-batch format: selection keeps one under EP only where it sends the same rows."""
    if p.kind == "fused":
        return {"fused": p.main.qualname}
    assert p.dispatcher is not None
    return {"dispatcher": p.dispatcher.qualname, "dispatch format": str(p.dispatch_fmt)}


class MoELayer(torch.nn.Module):
    """A Mixture-of-Experts layer running on the best backend for its config and hardware.

    Args:
        config: the layer's math (`MoEConfig`).
        quant: a `QuantScheme` or its name (`bf16`, `fp8_block`, `fp8_block:ue8m0`,
            `fp8_tensor`, `nvfp4`, `w8a8_int8`).
        backend: `auto`, or a backend name to force (its experts/fused forwards only).
            `auto` defers to `MOEHAL_BACKEND` if set.
        device: where the layer runs (default: the best device torch sees).
        layout: restrict to experts consuming this layout (`standard`, `contiguous`, `masked`).
        registry: plugins to select from (default: `moehal.discover()`).
        validate: check input *values* (expert ids in range and distinct, finite weights),
            which reads device memory back to the host. Shapes, dtypes and devices are always
            checked. Default: on for CPU, off elsewhere (the hot path must not sync).
        process_group: the torch.distributed group of the expert-parallel ranks when
            `config.ep_size > 1` and tokens move between processes.
        pipeline: build exactly this pipeline (one of `moehal.enumerate_pipelines(...)`)
            instead of selecting; conformance uses it to run every claimed format.
        cuda_graph_tokens: replay eager calls of up to this many tokens from CUDA graphs,
            captured once per token count (see `moehal.graphs`): removes per-call launch
            overhead for engines that run eagerly. 0 (default) = off. Also settable later as
            `layer.cuda_graph_tokens`.
        name: the layer's name in the model (e.g. `model.layers.3.mlp.experts`), shown by
            `repr` and added as a note to any exception its forward or weight loading raises,
            so a server's log says which of a model's layers failed.

    Call with `layer(hidden_states, topk_ids, topk_weights)` or
    `layer(hidden_states, router_logits=logits)` (needs `config.routing`).
    """

    def __init__(
        self,
        config: MoEConfig,
        quant: QuantScheme | str = "bf16",
        backend: str = "auto",
        device: torch.device | str | None = None,
        *,
        layout: str | None = None,
        registry: Registry | None = None,
        validate: bool | None = None,
        process_group: Any = None,
        pipeline: Pipeline | None = None,
        cuda_graph_tokens: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name must be a str or None, got {type(name).__name__}")
        self.layer_name = name
        if not isinstance(config, MoEConfig):  # else a plugin's capability check meets it first, and is blamed
            raise ConfigError(f"MoELayer takes a moehal.MoEConfig, got {type(config).__name__}")
        if registry is not None and not isinstance(registry, Registry):
            raise ConfigError(f"registry must be a moehal Registry (moehal.discover()), got {type(registry).__name__}")
        self.config = config
        self.quant = QuantScheme.parse(quant)
        if validate is not None and not isinstance(validate, bool):
            raise ConfigError(f"validate must be True, False or None (the device's default), got {validate!r}")
        if isinstance(layout, Layout):
            layout = layout.value
        if layout is not None and not isinstance(layout, str):  # (a plugin may declare layouts of its own)
            raise ConfigError(f"layout must be a layout name ('standard', 'contiguous', 'masked') or None: {layout!r}")
        if device is not None and as_device(device).type == "meta":
            raise NotSupportedError(
                "MoELayer on the meta device: moehal selects its kernels for the device the layer runs on "
                "and builds their buffers there. Build it on that device (construction allocates no "
                "weights; load_weights comes after the model is materialized)"
            )
        reg = registry if registry is not None else discover()
        hw: HardwareInfo = detect(device)
        chosen = backend if backend != "auto" else reg.settings.backend
        self.request = BuildRequest(config, self.quant, hw, reg.settings, process_group)
        if process_group is not None and config.ep_size > 1:
            # The group against ep_rank/ep_size, before selection: a mismatch is the caller's
            # config, which every dispatcher over the group would decline (a NoBackendError of
            # every backend's reasons, this one among them).
            group = check_process_group(self.request)
            if not group.ok and group.reason.startswith(("the process group has", "this process is rank")):
                raise ConfigError(group.reason)
        if pipeline is not None:
            self.plan: Plan = Plan(self.request, _accepted(pipeline, self.request, reg, layout), (), ())
        else:
            self.plan = select(self.request, reg, chosen, layout)
        if process_group is not None and config.ep_size > 1:  # before any runner's collective setup
            check_ranks_agree(self.request, _wire(self.plan.pipeline))
        _log_plan(self.plan, hw)
        main = self.plan.pipeline.main
        if main.fallback and hw.kind != "cpu" and chosen != main.backend:  # (asked for by name: meant)
            warn(
                f"MoELayer ({config.describe()}) on {hw.device} ({hw.name}) runs {self.quant} on the slow "
                f"fallback {main.qualname}: no native kernel took this configuration. It loops over experts "
                "in float32 on weights dequantized at load (4x an fp8 checkpoint's bytes). Why each kernel "
                f"declined: {_explain_command(config, self.quant)}",
                FallbackWarning,
            )
        self.device = hw.device
        self._on_cuda = self.device.type == "cuda"
        self._device_index = self.device.index if self._on_cuda else -1  # (`Tensor.get_device()`)
        # forwards on this device in one order across streams and threads (shared scratch),
        # with the device current while they queue (Triton launches on the current device)
        self._order: StreamOrder | None = stream_order.for_device(self.device) if self._on_cuda else None
        self.validate_values = validate if validate is not None else hw.kind == "cpu"
        with self._order or contextlib.nullcontext():  # runners that allocate (a vendor's wrapper,
            self._build_runners()  # DeepEP's buffers) do so on the current device: the layer's
        self._weights: ExpertWeights | None = None
        self._correction_bias: torch.Tensor | None = None
        self._processed = False
        self._op_id = custom_op.register_layer(self)  # torch.compile sees the layer as one custom op
        self._graph_tokens = 0
        self._graphs_topk = GraphCache(self._forward_topk, self.device)
        self._graphs_logits = GraphCache(self._forward_logits, self.device)
        self.cuda_graph_tokens = cuda_graph_tokens

    def _build_runners(self) -> None:
        """The plan's runners, built for this layer (at construction, and for a copy)."""
        p = self.plan.pipeline
        self._fused: FusedRunner | None = None
        self._dispatch: DispatchRunner | None = None
        # batches of <= _small_tokens tokens or of _prefill_lo to _prefill_hi (`SmallBatchFormat.takes`)
        self._small_dispatch: DispatchRunner | None = None
        self._small_tokens = -1
        self._prefill_lo = self._prefill_hi = sys.maxsize
        self._adapter: QuantizeAdapter | None = None
        self._experts: ExpertsRunner | None = None
        if p.kind == "fused":
            assert p.fused is not None
            self._fused = p.fused.build(self.request)
            self._accepts_topk = "topk" in p.fused.accepts
        else:
            assert p.dispatcher and p.experts and p.fmt and p.dispatch_fmt
            self._dispatch = p.dispatcher.build(self.request, p.dispatch_fmt)
            if p.small is not None:
                self._small_dispatch = p.dispatcher.build(self.request, p.small.fmt)
                self._small_tokens = p.small.max_tokens
                if p.small.prefill_min_tokens is not None:
                    self._prefill_lo = p.small.prefill_min_tokens
                    self._prefill_hi = p.small.prefill_max_tokens or sys.maxsize
            self._adapter = QuantizeAdapter(p.fmt) if p.adapter else None
            self._experts = p.experts.build(self.request, p.fmt)
            self._accepts_topk = True

    # Copies (copy.deepcopy, pickle) -----------------------------------------------------------
    _RUNNERS = ("_fused", "_dispatch", "_small_dispatch", "_adapter", "_experts")

    def __getstate__(self) -> dict[str, Any]:
        """A copy is the layer built again from its plan, with a copy of the weights loaded so
        far. Runners whose weights are processed are copied as they are, on the CPU only: on an
        accelerator their bound launches hold this layer's buffer addresses, so a copy would
        run on the original's buffers."""
        if self._processed and self.device.type != "cpu":
            raise NotSupportedError(
                f"a layer whose weights are processed on {self.device} cannot be copied: its kernels' "
                "launches hold the addresses of this layer's buffers. Copy the model before "
                "load_weights, or build a new MoELayer and load the weights into it"
            )
        state = self.__dict__.copy()
        state["_order"] = None  # the device's one order, taken again by the copy
        state["_graphs_topk"] = state["_graphs_logits"] = None  # graphs of this layer's buffers
        if not self._processed:
            for name in self._RUNNERS:  # built again from the plan: nothing of them is loaded yet
                state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and unpickling build a new layer from the old one's state (`__getstate__`):
        # it needs an id of its own, or a compiled graph of the copy would run the original's weights
        super().__setstate__(state)
        self.__dict__.setdefault("layer_name", None)  # (a layer pickled before layers had names)
        self._order = stream_order.for_device(self.device) if self._on_cuda else None
        if not self._processed:
            with self._order or contextlib.nullcontext():
                self._build_runners()
        self._graphs_topk = GraphCache(self._forward_topk, self.device)
        self._graphs_logits = GraphCache(self._forward_logits, self.device)
        self._op_id = custom_op.register_layer(self)

    @property
    def cuda_graph_tokens(self) -> int:
        """Eager calls with at most this many tokens replay a per-token-count CUDA graph (0: off)."""
        return self._graph_tokens

    @cuda_graph_tokens.setter
    def cuda_graph_tokens(self, limit: int) -> None:
        try:  # numpy and torch integers too, as MoEConfig's sizes (`config._as_int`)
            if isinstance(limit, bool):
                raise TypeError
            limit = operator.index(limit)
        except TypeError:
            raise InputError(f"cuda_graph_tokens must be an int >= 0, got {limit!r}") from None
        if limit < 0:
            raise InputError(f"cuda_graph_tokens must be >= 0, got {limit}")
        if limit and self.device.type != "cuda":
            raise NotSupportedError(f"cuda_graph_tokens needs a CUDA device; this layer runs on {self.device}")
        if limit and not self.plan.pipeline.graph_capturable:
            raise NotSupportedError(
                f"{self.plan.pipeline.name} does not declare CUDA-graph capture (graph_capturable), so its "
                "forward cannot be replayed from a graph; leave cuda_graph_tokens at 0"
            )
        if limit != self._graph_tokens:
            self._graphs_topk.clear()
            self._graphs_logits.clear()
        self._graph_tokens = limit

    # Weights -------------------------------------------------------------------------------
    def load_weights(
        self, weights: ExpertWeights | None = None, *, process: bool = True, **tensors: torch.Tensor
    ) -> None:
        """Load this rank's expert weights in the canonical layout (see `moehal.weights`),
        either as an `ExpertWeights` or as keyword tensors (`w13=..., w2=..., w13_scale=...`).
        With `process` (default) the chosen kernel's weight processing runs right after.
        A layer built with a `name` adds it as a note to what this raises.

        The tensors become the layer's: where a kernel consumes the canonical layout as given,
        it keeps them rather than a copy (no second copy of the weights). Do not modify or
        reuse them afterwards (an engine refilling one staging buffer per layer would change
        every earlier layer's weights); new weights need a new layer."""
        try:
            self._load_weights(weights, process, tensors)
        except Exception as exc:
            self._note_name(exc)
            raise

    def _load_weights(self, weights: ExpertWeights | None, process: bool, tensors: dict[str, torch.Tensor]) -> None:
        if self._processed:
            raise WeightsAlreadyProcessedError(
                "weights were already loaded and processed for this layer; build a new MoELayer "
                "to load different weights"
            )
        if weights is not None and not isinstance(weights, ExpertWeights):
            raise WeightError(
                f"load_weights takes an ExpertWeights or keyword tensors, got {type(weights).__name__}"
                + (" (a dict: load_weights(**weights))" if isinstance(weights, dict) else "")
            )
        if weights is None:
            try:
                w = ExpertWeights(**tensors)
            except TypeError as exc:  # a misspelt or missing field
                names = ", ".join(f.name for f in dataclasses.fields(ExpertWeights))
                raise WeightError(f"load_weights: {exc}; the fields are {names}") from None
        else:
            w = weights
        validate(w, self.config, self.quant, self.device)
        self._weights = w
        self._correction_bias = w.correction_bias
        if process:
            self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        """Run the chosen kernel's weight transform, exactly once."""
        try:
            self._process_weights()
        except Exception as exc:
            self._note_name(exc)
            raise

    def _process_weights(self) -> None:
        if self._processed:
            raise WeightsAlreadyProcessedError(
                f"process_weights_after_loading already ran for {self.plan.pipeline.name}; applying "
                "a layout transform twice would silently corrupt the weights"
            )
        if self._weights is None:
            raise WeightsNotLoadedError("call layer.load_weights(...) before processing weights")
        proc = self.plan.pipeline.processor
        with self._order or contextlib.nullcontext():  # processors and loads may launch kernels
            self._hand_input_scale(self._weights)
            prepared: Any = proc.process(self._weights, self.request) if proc is not None else self._weights
            runner = self._fused if self._fused is not None else self._experts
            assert runner is not None
            runner.load(prepared)
        self._weights = None  # the runner owns the (possibly transformed) copy now
        self._processed = True

    def _hand_input_scale(self, weights: ExpertWeights) -> None:
        """Dispatchers that quantize with the checkpoint's static input scale get it now."""
        takers: list[Any] = [d for d in (self._dispatch, self._small_dispatch) if d is not None]
        takers += [self._adapter] if self._adapter is not None else []
        for taker in takers:
            fmt = taker.target if isinstance(taker, QuantizeAdapter) else taker.fmt
            if fmt.scales is not ScaleKind.STATIC_TENSOR:
                continue
            if weights.a13_scale is None:
                raise WeightError(f"{fmt} input quantizes with a static input scale: the weights lack a13_scale")
            taker.load_input_scale(weights.a13_scale.to(self.device, torch.float32).reshape(1).contiguous())

    @property
    def weights_ready(self) -> bool:
        return self._processed

    @property
    def accepts_topk(self) -> bool:
        """Whether `layer(x, topk_ids, topk_weights)` is served. False where the selected pipeline
        routes inside its kernel from router logits only (TensorRT-LLM's fused MoE on SM100, for a
        config with `routing`): an engine that routes itself checks this at start-up, or builds
        with `routing=None`."""
        return self._accepts_topk

    @property
    def accepts_router_logits(self) -> bool:
        """Whether `layer(x, router_logits=...)` is served: the config has a `routing`."""
        return self.config.routing is not None

    # Forward -------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        router_logits: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states `[T, H]` in config.dtype -> `[T, H]`.

        topk_ids int32/int64 `[T, K]` global expert ids, topk_weights float `[T, K]`;
        or router_logits `[T, E]` (float32, or the layer dtype).
        out: a `[T, H]` tensor of config.dtype to write the result into (returned). An engine
        that passes the same buffers call after call gets, with `cuda_graph_tokens`, a replay
        that reads its inputs and writes `out` in place: one graph launch, no copies.
        On a CUDA device, forwards run in the order they are queued, whatever stream or thread
        queues them, with the layer's device current (`moehal.stream_order`: the backends'
        scratch is shared by layers, and Triton launches on the current device).
        """
        if torch.compiler.is_compiling():  # one opaque node: moehal::moe_forward[_logits]
            if out is not None:  # (shapes, dtypes and devices only: traceable) as eager checks it
                self._check_out(out, hidden_states, traced=True)
            y = custom_op.traced_forward(self, hidden_states, topk_ids, topk_weights, router_logits)
            return y if out is None else out.copy_(y)
        order = self._order
        try:
            if order is None:
                return self._forward(hidden_states, topk_ids, topk_weights, router_logits, out)
            with order:
                return self._forward(hidden_states, topk_ids, topk_weights, router_logits, out)
        except Exception as exc:
            self._note_name(exc)
            raise

    def _note_name(self, exc: BaseException) -> None:
        """Name this layer in `exc` (a note: the type and message stay the caller's to match),
        once, where the layer has a name and Python has notes (3.11+)."""
        if self.layer_name is None or not hasattr(exc, "add_note"):
            return
        note = f"(in moehal layer {self.layer_name!r})"
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    def _forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        router_logits: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if self._graph_tokens and not self.validate_values:  # an engine's steady state: one replay
            if router_logits is None:
                y = self._graphs_topk.replay_direct((hidden_states, topk_ids, topk_weights), out)
            elif topk_ids is None and topk_weights is None:  # both kinds given: the checked path raises
                y = self._graphs_logits.replay_direct((hidden_states, router_logits), out)
            else:
                y = None
            if y is not None:
                return y
        if not self._processed:
            if self._weights is not None:
                raise WeightsNotLoadedError(
                    "the weights are loaded but not processed (load_weights(..., process=False)): call "
                    "layer.process_weights_after_loading() first"
                )
            raise WeightsNotLoadedError("the layer has no weights: call layer.load_weights(...) first")
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden_states, topk_weights, router_logits)
        ):
            self._warn_inference_only()
            with torch.no_grad():  # every backend alike: no gradient, rather than some backends' partial ones
                return self._forward(hidden_states, topk_ids, topk_weights, router_logits, out)
        self._check_hidden(hidden_states)
        if out is not None:
            self._check_out(out, hidden_states)
        if router_logits is not None:
            if topk_ids is not None or topk_weights is not None:
                raise InputError("pass either topk_ids/topk_weights or router_logits, not both")
            self._check_logits(router_logits, hidden_states)
            if should_replay(self._graph_tokens, hidden_states):
                return self._graphs_logits(hidden_states, router_logits, out=out)
            return self._forward_logits(hidden_states, router_logits, out)
        if topk_ids is None or topk_weights is None:
            raise InputError("pass topk_ids and topk_weights (or router_logits=...)")
        self._check_topk(topk_ids, topk_weights, hidden_states)
        if not self._accepts_topk:
            raise InputError(
                f"{self.plan.pipeline.name} routes inside the kernel and takes router_logits only; "
                "pass router_logits=..., or build the layer with MoEConfig.routing=None"
            )
        if should_replay(self._graph_tokens, hidden_states):
            return self._graphs_topk(hidden_states, topk_ids, topk_weights, out=out)
        return self._forward_topk(hidden_states, topk_ids, topk_weights, out)

    def _warn_inference_only(self) -> None:
        if not self.__dict__.get("_warned_grad"):
            self._warned_grad = True
            warn(
                "MoELayer is inference-only: its kernels have no backward, so it runs without recording "
                "autograd and its output carries no gradient (to the inputs, the router or the experts). "
                "Call it under torch.no_grad() or torch.inference_mode(); train with another implementation.",
                InferenceOnlyWarning,
            )

    def _apply(self, fn: Any, recurse: bool = True) -> MoELayer:
        """`.to()`, `.cuda()`, `.half()`, `to_empty()` and the like: the layer's kernels, buffers
        and processed weights are built for one device and dtype, so a conversion that would
        change either raises (it silently did nothing before); one that changes neither passes."""
        probe = torch.empty(0, device=self.device, dtype=self.config.dtype)
        moved = fn(probe)
        if isinstance(moved, torch.Tensor) and (moved.device != probe.device or moved.dtype != probe.dtype):
            raise NotSupportedError(
                f"a MoELayer cannot be converted from {self.device} {self.config.dtype} to {moved.device} "
                f"{moved.dtype}: its kernels were selected and its weights processed for the first. Build "
                "a new MoELayer (MoEConfig.with_(dtype=...), device=...) and load the weights into it"
            )
        return super()._apply(fn, recurse)

    # The hot path proper: inputs already checked; no lookups, no host sync.
    def _forward_logits(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.plan.pipeline.routes_internally:
            assert self._fused is not None
            if hidden_states.stride(-1) != 1:  # see `_forward_topk`
                hidden_states = hidden_states.contiguous()
            y = self._fused_output(self._fused.forward(hidden_states, None, router_logits), hidden_states)
            return y if out is None else out.copy_(y)
        routing = self.config.routing
        assert routing is not None
        topk = route(router_logits, self.config.top_k, routing, self._correction_bias)
        return self._forward_topk(hidden_states, topk.ids, topk.weights, out)

    def _forward_topk(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward; with `out`, the result is written there (and returned). Runners get
        `out` (`ExpertsRunner.apply_into`, `DispatchRunner.combine_into`) only where it is
        contiguous and not the input itself: an in-place call (`out=hidden_states`) must not be
        written before the pipeline has read its input, so it gets a copy."""
        if out is not None and (self._fused is not None or out.data_ptr() == hidden_states.data_ptr()
                                or not out.is_contiguous()):  # fmt: skip
            return out.copy_(self._forward_topk(hidden_states, topk_ids, topk_weights))
        if hidden_states.stride(-1) != 1:  # runners get rows of unit column stride (any row stride):
            hidden_states = hidden_states.contiguous()  # kernels index a row's columns densely
        topk = TopK(topk_ids, topk_weights)
        if self._fused is not None:
            return self._fused_output(self._fused.forward(hidden_states, topk, None), hidden_states)
        assert self._dispatch is not None and self._experts is not None
        t = hidden_states.shape[0]
        if t <= self._small_tokens or self._prefill_lo <= t <= self._prefill_hi:  # the experts' small-batch format
            assert self._small_dispatch is not None
            disp = self._small_dispatch
            dispatched, handle = disp.dispatch(hidden_states, topk)
        else:
            disp = self._dispatch
            dispatched, handle = disp.dispatch(hidden_states, topk)
            if self._adapter is not None:
                dispatched = self._adapter(dispatched)
        if out is None:
            return disp.combine(self._experts.apply(dispatched), handle)
        y = self._experts.apply_into(dispatched, out) if disp.tokens_in_place else self._experts.apply(dispatched)
        return disp.combine_into(y, handle, out)

    def _fused_output(self, y: Any, x: torch.Tensor) -> torch.Tensor:
        """A fused forward's result, checked as the layer's own (shapes and dtype, no sync): one
        that returned fp32 or another row count was handed to the caller as it was."""
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
            what = f"{list(y.shape)} {y.dtype} on {y.device}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise ContractError(
                f"{self.plan.pipeline.name} returned {what} for {list(x.shape)} {x.dtype} hidden states on "
                f"{x.device}: a fused forward returns the layer's output, shaped and typed as its input"
            )
        return y

    def trace(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        path: Literal["auto", "main", "small"] = "auto",
        dirty_padding: bool = False,
    ) -> dict[str, Any]:
        """Run a modular pipeline stage by stage and return every intermediate
        (`dispatched`, `adapted`, `expert_out`, `out`): for debugging and conformance.

        path: "auto" takes the branch a forward of this many tokens takes; "main" the
        pipeline's main format (`plan.pipeline.fmt`) and "small" its small-batch format
        (`plan.pipeline.small`) whatever the batch size, so a check of one format's contract
        (conformance's padding rows, say) is not sent to the other by the batch size.
        dirty_padding: the experts get a copy of a grouped input whose padding rows hold NaN
        (`moehal.formats.with_dirty_padding`, returned as `adapted`), as a dispatcher that
        leaves them as they were would hand them over."""
        if self._dispatch is None or self._experts is None:
            raise InputError(f"{self.plan.pipeline.name} is fused: it has no stages to trace")
        if not self._processed:
            if self._weights is not None:
                raise WeightsNotLoadedError(
                    "the weights are loaded but not processed (load_weights(..., process=False)): call "
                    "layer.process_weights_after_loading() first"
                )
            raise WeightsNotLoadedError("the layer has no weights: call layer.load_weights(...) first")
        topk = TopK(topk_ids, topk_weights)
        self._check_hidden(hidden_states)
        self._check_topk(topk_ids, topk_weights, hidden_states)
        t = hidden_states.shape[0]
        if path == "auto":
            small = t <= self._small_tokens or self._prefill_lo <= t <= self._prefill_hi
        elif path in ("main", "small"):
            small = path == "small"
            if small and self._small_dispatch is None:
                raise InputError(f"{self.plan.pipeline.name} has no small-batch format to trace")
        else:
            raise InputError(f"path must be 'auto', 'main' or 'small', got {path!r}")
        disp = self._small_dispatch if small else self._dispatch
        assert disp is not None
        with self._order or contextlib.nullcontext():
            dispatched, handle = disp.dispatch(hidden_states, topk)
            adapted = self._adapter(dispatched) if self._adapter is not None and not small else dispatched
            if dirty_padding and isinstance(adapted, (MaskedInput, ContiguousInput)):
                adapted = with_dirty_padding(adapted)
            expert_out = self._experts.apply(adapted)
            out = disp.combine(expert_out, handle)
        return {"dispatched": dispatched, "adapted": adapted, "expert_out": expert_out, "out": out}

    # Input checks --------------------------------------------------------------------------
    # These run on every eager call that no direct graph serves (see `GraphCache.replay_direct`),
    # so they compare in the cheapest terms torch offers.
    def _check_hidden(self, x: torch.Tensor) -> None:
        c = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != c.hidden_size:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"hidden_states must be [T, {c.hidden_size}], got {shape}")
        if x.dtype != c.dtype:
            raise InputError(f"hidden_states dtype is {x.dtype}; this layer was built for {c.dtype}")
        if x.get_device() != self._device_index if self._on_cuda else x.device.type != self.device.type:
            raise InputError(f"hidden_states is on {x.device}; the layer is on {self.device}")
        if c.max_tokens is not None and x.shape[0] > c.max_tokens:
            raise InputError(f"{x.shape[0]} tokens exceed MoEConfig.max_tokens={c.max_tokens}")

    def _check_topk(self, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
        c = self.config
        want = (x.shape[0], c.top_k)
        for name, t in (("topk_ids", ids), ("topk_weights", w)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor [{want[0]}, {want[1]}], got {type(t).__name__}")
        if ids.shape != want or w.shape != want:
            raise InputError(
                f"topk_ids and topk_weights must be {list(want)}, got {list(ids.shape)} and {list(w.shape)}"
            )
        if ids.dtype not in _ID_DTYPES:
            raise InputError(f"topk_ids must be int32 or int64, got {ids.dtype}")
        if not w.is_floating_point():
            raise InputError(f"topk_weights must be floating point, got {w.dtype}")
        if ids.device != x.device or w.device != x.device:
            raise InputError(f"topk tensors are on {ids.device}/{w.device}, hidden_states on {x.device}")
        if self.validate_values and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            first = -1 if c.topk_padding else 0  # -1: a padded slot
            if lo < first or hi >= c.num_experts:
                allowed = f"[{first}, {c.num_experts})"
                hint = "" if c.topk_padding or lo != -1 else "; for -1 padding ids, build with topk_padding=True"
                raise InputError(f"topk_ids out of range: found [{lo}, {hi}], allowed {allowed}{hint}")
            if c.top_k > 1:
                s = ids.sort(dim=1).values
                if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
                    raise InputError("topk_ids repeat an expert within a token; each token's ids must be distinct")
            if not bool(torch.isfinite(w).all()):
                raise InputError("topk_weights contain NaN or Inf")

    def _check_out(self, out: torch.Tensor, x: torch.Tensor, traced: bool = False) -> None:
        """traced: while a compiler traces, where the token count may be a symbol with no value
        (an unbacked size): rows are compared with `torch._check`, which adds no guard."""
        if (
            not isinstance(out, torch.Tensor)
            or out.dim() != 2
            or x.dim() != 2
            or out.shape[1] != x.shape[1]
            or out.dtype != x.dtype
            or (not traced and out.shape[0] != x.shape[0])
        ):
            what = f"{list(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise InputError(f"out must be {list(x.shape)} {x.dtype} like hidden_states, got {what}")
        if traced:
            torch._check(out.shape[0] == x.shape[0], lambda: "out must be [T, H] with the T rows of hidden_states")
        if out.device != x.device:
            raise InputError(f"out is on {out.device}, hidden_states on {x.device}")
        if 0 in out.stride() and out.numel() > 1:  # (an expanded view: every row the same memory)
            raise InputError(f"out must not be an expanded view (strides {out.stride()}): pass a tensor of its own")

    def _check_logits(self, logits: torch.Tensor, x: torch.Tensor) -> None:
        c = self.config
        if c.routing is None:
            raise InputError("router_logits given, but MoEConfig.routing is None: set a RoutingConfig")
        if not isinstance(logits, torch.Tensor):
            raise InputError(f"router_logits must be a torch.Tensor [T, {c.num_experts}], got {type(logits).__name__}")
        if list(logits.shape) != [x.shape[0], c.num_experts]:
            raise InputError(f"router_logits must be [{x.shape[0]}, {c.num_experts}], got {list(logits.shape)}")
        if not logits.is_floating_point():
            raise InputError(f"router_logits must be floating point, got {logits.dtype}")
        if logits.device != x.device:
            raise InputError(f"router_logits is on {logits.device}, hidden_states on {x.device}")

    def extra_repr(self) -> str:
        mode = self.plan.pipeline.execution_mode(self.request)
        return (
            ("" if self.layer_name is None else f"name={self.layer_name!r}, ")
            + f"{self.config.describe()}, quant={self.quant.name}, pipeline={self.plan.pipeline.name}, "
            f"device={self.device}" + ("" if mode == "native" else f", mode={mode}")
        )
