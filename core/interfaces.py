"""What a backend implements: dispatchers, experts kernels, fused forwards, weight processors.

A plugin returns *instances* of these from its hooks (see `moehal.hookspecs`). Each declares
what it supports through small named predicates returning `Decision`s; the planner in
`moehal.selection` calls them once, at layer build. After that the layer holds plain bound
runners: no plugin lookup happens per forward.

Implementations must import vendor libraries lazily (inside `check_libraries` or `build`),
so that declaring them never fails on a machine without that vendor's stack.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, all_of, decline, require
from moehal.config import Activation, MoEConfig
from moehal.errors import MoEHalError, PluginCheckError
from moehal.formats import ActivationFormat, CombineInput, DispatchOutput, SmallBatchFormat
from moehal.hardware import HardwareInfo
from moehal.quant import QuantScheme
from moehal.routing import RoutingMethod, TopK
from moehal.settings import Settings
from moehal.weights import ExpertWeights

__all__ = [
    "ALL_ACTIVATIONS",
    "ALL_DEVICES",
    "BackendInfo",
    "BuildRequest",
    "DispatchRunner",
    "Dispatcher",
    "Experts",
    "ExpertsRunner",
    "FusedForward",
    "FusedRunner",
    "Implementation",
    "TunedShape",
    "WeightProcessor",
    "check_padding_ids",
]

ALL_DEVICES = frozenset({"cpu", "cuda", "rocm", "npu"})
ALL_ACTIVATIONS = frozenset(Activation)


@dataclass(frozen=True)
class BuildRequest:
    """Everything an implementation may look at to accept or decline, and to build."""

    config: MoEConfig
    quant: QuantScheme
    hardware: HardwareInfo
    settings: Settings = field(default_factory=Settings)
    process_group: Any = None  # torch.distributed group for expert parallelism (None: one process)

    @property
    def device(self) -> torch.device:
        return self.hardware.device

    def emulating(self, backend: str) -> bool:
        return backend in self.settings.emulate


@dataclass(frozen=True)
class TunedShape:
    """A layer configuration at which an implementation runs other code than at conformance's
    small shapes: a table of tuned tiles, kernels or bands keyed by the exact shape (the CUDA
    backend's `tuned/masked_gemm.<device>.json`). `tokens` are batch sizes that reach each of
    those paths (one per path is enough). Conformance proves these too (family `tuned`), so
    that the kernels a benchmark times at real model shapes are the kernels it checked.

    name: a short label for case ids (e.g. 'qwen3_30b_a3b'); why: which paths the sizes reach."""

    name: str
    config: MoEConfig
    quant: QuantScheme
    tokens: tuple[int, ...]
    why: str = ""

    @classmethod
    def covering(
        cls, name: str, config: MoEConfig, quant: QuantScheme, path_of: Callable[[int], object], why: str = ""
    ) -> TunedShape:
        """The smallest batch size of each distinct path from 1 to `config.max_tokens`
        (`path_of(tokens)`: any hashable description of what runs, e.g. the tiles a table
        picks), so that every path is checked once. `why` gains the number of paths."""
        if config.max_tokens is None:
            raise ValueError("TunedShape.covering needs config.max_tokens: the largest batch to look at")
        first: dict[object, int] = {}
        for t in range(1, config.max_tokens + 1):
            first.setdefault(path_of(t), t)
        paths = f"{len(first)} path{'s' if len(first) != 1 else ''}"
        return cls(name, config, quant, tuple(sorted(first.values())), f"{paths}: {why}" if why else paths)


@dataclass(frozen=True)
class BackendInfo:
    """What `moehal doctor` shows for a plugin.

    name: the backend name (its entry-point name). version: the plugin's version.
    available: hardware -> Decision (is this backend usable on this machine at all).
    libraries: vendor distribution -> installed version or None.
    """

    name: str
    version: str
    description: str
    available: Callable[[HardwareInfo], Decision] = lambda hw: accept("always available")
    libraries: Callable[[], dict[str, str | None]] = dict


class Implementation(ABC):
    """Common declarations. Subclasses set the class attributes and may override checks.

    `supports(req)` runs the named predicates in order: hardware, libraries, quant,
    activation, parallel, shape; the first decline is the answer.
    """

    name: ClassVar[str]
    backend: str = ""  # set by the registry to the plugin's name when left empty
    priority: ClassVar[int] = 0  # higher wins; ties are broken by name, never by install order
    description: ClassVar[str] = ""
    devices: ClassVar[frozenset[str]] = ALL_DEVICES
    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset()
    activations: ClassVar[frozenset[Activation]] = ALL_ACTIVATIONS
    supports_non_gated: ClassVar[bool] = True
    supports_bias: ClassVar[bool] = True
    supports_router_weight_on_input: ClassVar[bool] = True
    graph_capturable: ClassVar[bool] = False  # forward does no host sync and keeps static shapes
    deterministic: ClassVar[bool] = True  # bitwise-equal results on the same inputs
    emulates: ClassVar[bool] = False  # True: runs torch stand-ins of vendor ops (reported `emulated`)
    fallback: ClassVar[bool] = False  # True: a slow catch-all; the plan says so when it is chosen

    def tuned_shapes(self, req: BuildRequest) -> Sequence[TunedShape]:
        """Configurations on `req.hardware` (`req.config` is a placeholder) where this runs
        other code than at small shapes, with batch sizes reaching each path (see
        `TunedShape`). The default: none, the same code at every shape."""
        return ()

    def execution_mode(self, req: BuildRequest) -> str:
        """How this runs for `req`: 'native', 'emulated' (torch stand-ins of vendor ops,
        explicitly enabled) or 'interpreted' (real kernel code under an interpreter such as
        TRITON_INTERPRET=1). Conformance reports show it next to every result."""
        return "emulated" if self.emulates else "native"

    @property
    def qualname(self) -> str:
        return f"{self.backend}.{self.name}"

    # Named predicates ------------------------------------------------------------------------
    def check_hardware(self, req: BuildRequest) -> Decision:
        return require(
            req.hardware.kind in self.devices, f"runs on {sorted(self.devices)}, not {req.hardware.kind}", "hardware"
        )

    def check_libraries(self, req: BuildRequest) -> Decision:
        return accept(predicate="libraries")

    def check_quant(self, req: BuildRequest) -> Decision:
        names = sorted(s.name for s in self.quant_schemes)
        return require(req.quant in self.quant_schemes, f"quant {req.quant.name} not in {names}", "quant")

    def check_activation(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.activation not in self.activations:
            return decline(
                f"activation {c.activation.value} not in {sorted(a.value for a in self.activations)}", "activation"
            )
        if not c.gated and not self.supports_non_gated:
            return decline("non-gated experts are not supported", "activation")
        if (c.has_w13_bias or c.has_w2_bias) and not self.supports_bias:
            return decline("expert biases are not supported", "activation")
        if c.apply_router_weight_on_input and not self.supports_router_weight_on_input:
            return decline("apply_router_weight_on_input is not supported", "activation")
        return accept(predicate="activation")

    def check_parallel(self, req: BuildRequest) -> Decision:
        return accept(predicate="parallel")

    def check_shape(self, req: BuildRequest) -> Decision:
        return accept(predicate="shape")

    def supports(self, req: BuildRequest) -> Decision:
        """The named predicates in order; the first decline is the answer. A predicate that
        raises (a plugin bug, not a decline) becomes `PluginCheckError`, naming the
        implementation, so that a broken plugin is neither skipped in silence nor reported as
        an anonymous traceback from inside selection."""
        try:
            return all_of(
                [
                    ("hardware", lambda: self.check_hardware(req)),
                    ("libraries", lambda: self.check_libraries(req)),
                    ("quant", lambda: self.check_quant(req)),
                    ("activation", lambda: self.check_activation(req)),
                    ("parallel", lambda: self.check_parallel(req)),
                    ("shape", lambda: self.check_shape(req)),
                ]
            )
        except MoEHalError:
            raise
        except Exception as exc:
            raise PluginCheckError.raised(self.qualname, self.backend, "a capability check", exc) from exc


# --- dispatch / combine ---------------------------------------------------------------------


class DispatchRunner(ABC):
    """A dispatcher bound to one layer and one output format.

    `dispatch` returns the experts' input and an opaque handle that `combine` needs; the
    handle is returned rather than stored so that two micro-batches can overlap.
    """

    fmt: ActivationFormat
    # Its token-major (STANDARD) output holds the layer's own tokens, row for row, as on one
    # device where no token moves: experts may then write the layer's result straight into the
    # caller's `out=` buffer (`ExpertsRunner.apply_into`). False for dispatchers that move
    # tokens between ranks, whose experts see other rows.
    tokens_in_place: ClassVar[bool] = False

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[DispatchOutput, Any]:
        """hidden `[T, H]` in config.dtype, unit column stride (any row stride: the layer makes
        other inputs contiguous); topk ids are *global* expert ids. The top-k tensors arrive as
        the caller passed them: ids int32 or int64, weights of any float dtype, either of any
        strides. Make them contiguous (and cast them) before a kernel takes their pointers."""

    @abstractmethod
    def combine(self, expert_out: CombineInput, handle: Any) -> torch.Tensor:
        """Back to `[T, H]` in config.dtype: weighted (per the layout), summed over k,
        times routed_scaling_factor."""

    def load_input_scale(self, scale: torch.Tensor) -> None:
        """Formats with `ScaleKind.STATIC_TENSOR` only: the static activation scale to quantize
        with (fp32, one element, on the layer's device: the weights' `a13_scale`). The layer
        hands it over when it processes the weights, before any dispatch. Dispatchers that
        never accept such a format keep this default."""
        raise NotImplementedError(f"{type(self).__name__} does not quantize with a static input scale")

    def combine_into(self, expert_out: CombineInput, handle: Any, out: torch.Tensor) -> torch.Tensor:
        """`combine`, with the result in `out` (`[T, H]`, config.dtype, contiguous rows: the
        caller's `out=` buffer, never one of the layer's inputs), which it returns.

        The default copies `combine`'s result, unless that already is `out` (experts that
        finished the combine in `out` themselves, see `ExpertsRunner.apply_into`). Override it
        where the combine kernel can write any buffer: an `out=` forward, and the CUDA graph
        captured from it, then queue no copy."""
        y = self.combine(expert_out, handle)
        return y if y is out else out.copy_(y)


def check_padding_ids(drops: bool, req: BuildRequest) -> Decision:
    """The `padding_ids` predicate of what reads the caller's global top-k ids (dispatchers,
    fused forwards): layers built with `MoEConfig.topk_padding` need -1 ids dropped."""
    if not req.config.topk_padding or drops:
        return accept(predicate="padding_ids")
    return decline(
        "does not declare dropping -1 top-k ids (drops_padding_ids), which MoEConfig.topk_padding "
        "asks for; drop padded tokens before the layer instead",
        "padding_ids",
    )


class Dispatcher(Implementation):
    """Moves tokens to experts and back (single-device permute, DeepEP, HCCL, ...)."""

    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset()  # unused: dispatchers are scheme-agnostic
    # A global id of -1 is a slot that contributes nothing (a padded token's, say): it reaches no
    # expert and adds nothing to its token's row. Declared where the dispatcher's id mapping drops
    # it on every rank and the combine skips it; conformance's `padded_ids` check holds it to that.
    drops_padding_ids: ClassVar[bool] = False
    # Under expert parallelism across processes, each rank picks an experts kernel's small-batch
    # format from its own token count, so one dispatch may meet two formats on two ranks.
    # Declared where the collectives and the bytes each row carries depend on the format's dtype
    # and scales only, not on its layout: selection then keeps a small format of the main
    # format's dtype and scales (and drops any other, with the reason).
    same_wire_for_every_layout: ClassVar[bool] = False
    # Whether the grouped layouts this dispatcher produces hold zeros in their padding rows.
    # False where it leaves them as they were (DeepEP's low-latency receive buffer): conformance
    # then does not hold it to zeros, and every experts kernel must ignore padding anyway.
    zero_padding: ClassVar[bool] = True

    def check_quant(self, req: BuildRequest) -> Decision:
        return accept(predicate="quant")

    def supports(self, req: BuildRequest) -> Decision:
        d = super().supports(req)
        return d if not d.ok else check_padding_ids(self.drops_padding_ids, req)

    @abstractmethod
    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        """Whether this dispatcher can emit exactly `fmt` for this configuration."""

    @abstractmethod
    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        """Bind to a layer; allocate static buffers here, not per call."""


# --- experts --------------------------------------------------------------------------------


class ExpertsRunner(ABC):
    """An experts kernel bound to one layer and one input format."""

    fmt: ActivationFormat

    @abstractmethod
    def load(self, weights: Any) -> None:
        """Take the (processed) weights; called exactly once per layer."""

    @abstractmethod
    def apply(self, inp: DispatchOutput) -> CombineInput:
        """Run the local experts on a dispatch output of format `self.fmt`, or of the
        kernel's `small_batch_format` when it declared one."""

    def apply_into(self, inp: DispatchOutput, out: torch.Tensor) -> CombineInput:
        """`apply`, for a forward whose caller gave an output buffer `out` (`[T, H]`,
        config.dtype, contiguous rows, never one of the layer's inputs).

        Called only when the dispatcher declares `tokens_in_place`, so a token-major input's
        rows are the layer's tokens. Experts whose output is already the layer's result (a
        `StandardOutput` weighted and summed over k) may write it into `out` and return
        `StandardOutput(out, ...)`: the combine then copies nothing. The default ignores `out`
        and calls `apply`."""
        return self.apply(inp)


class Experts(Implementation):
    """A grouped-GEMM experts kernel: GEMM1 -> activation -> GEMM2 for local experts."""

    weight_layout: ClassVar[str] = "canonical"  # processed by the WeightProcessor of this layout

    @abstractmethod
    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        """Formats this kernel consumes for `req`, best first."""

    def small_batch_format(self, req: BuildRequest) -> SmallBatchFormat | None:
        """A format this kernel also consumes for batches of at most `max_tokens` tokens, used
        when the paired dispatcher produces it exactly (None: the main format at every size).
        The runner's `apply` must then take inputs of both formats."""
        return None

    @abstractmethod
    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner: ...


# --- fused forward --------------------------------------------------------------------------


class FusedRunner(ABC):
    """A fused forward bound to one layer: routing (when it routes itself), dispatch, experts
    and combine in one call. The layer calls `load` once with the processed weights, then
    `forward` per batch, instead of a dispatcher, an experts runner and a combine."""

    @abstractmethod
    def load(self, weights: Any) -> None:
        """Take the (processed) weights; called exactly once per layer."""

    @abstractmethod
    def forward(self, hidden: torch.Tensor, topk: TopK | None, router_logits: torch.Tensor | None) -> torch.Tensor:
        """The whole layer. Exactly one of topk / router_logits is given, per `accepts`."""


class FusedForward(Implementation):
    """One kernel doing routing (optionally), dispatch, experts and combine."""

    accepts: ClassVar[frozenset[str]] = frozenset({"topk"})  # 'topk' and/or 'logits'
    routing_methods: ClassVar[frozenset[RoutingMethod]] = frozenset()  # when it routes itself
    weight_layout: ClassVar[str] = "canonical"
    drops_padding_ids: ClassVar[bool] = False  # as `Dispatcher.drops_padding_ids`, for its top-k input

    def check_routing(self, req: BuildRequest) -> Decision:
        if "logits" not in self.accepts:
            return accept(predicate="routing")
        r = req.config.routing
        if r is None:
            if "topk" in self.accepts:
                return accept(predicate="routing")
            return decline("routes inside the kernel, but MoEConfig.routing is None", "routing")
        if r.method not in self.routing_methods and "topk" not in self.accepts:
            return decline(
                f"routing {r.method.value} not in {sorted(m.value for m in self.routing_methods)}", "routing"
            )
        return accept(predicate="routing")

    def supports(self, req: BuildRequest) -> Decision:
        d = super().supports(req)
        if d.ok:
            d = self.check_routing(req)
        if d.ok and "topk" in self.accepts:  # a logits-only kernel never sees top-k ids
            d = check_padding_ids(self.drops_padding_ids, req)
        return d

    def routes_internally(self, req: BuildRequest) -> bool:
        r = req.config.routing
        return "logits" in self.accepts and r is not None and r.method in self.routing_methods

    @abstractmethod
    def build(self, req: BuildRequest) -> FusedRunner: ...


# --- weight processors ----------------------------------------------------------------------


class WeightProcessor(Implementation):
    """Turns canonical weights into a kernel's layout (`layout`), once, after loading.

    Examples: DeepGEMM scale layouts, TensorRT-LLM row shuffles, Ascend NZ casts.
    """

    layout: ClassVar[str]
    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset()

    def check_quant(self, req: BuildRequest) -> Decision:
        if not self.quant_schemes:
            return accept(predicate="quant")
        return super().check_quant(req)

    @abstractmethod
    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        """Return the kernel-layout weights. Must not modify `weights` in place."""
