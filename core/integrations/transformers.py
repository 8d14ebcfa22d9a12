"""moehal as a Hugging Face transformers experts implementation.

transformers (>= 5) runs the experts of its MoE models through an interface:
`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS` maps a name to a function
`fn(experts_module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`,
and every experts class decorated with `@use_experts_implementation(...)` describes its weight
layout with flags on the module: `has_gate` (gate_up_proj, or up_proj only), `is_concatenated`
([gate; up] halves, or gate/up interleaved row by row), `is_transposed` (`[E, in, out]` instead
of `[E, out, in]`), `has_bias` (`*_proj_bias`) and `has_post_expert_norm`.

Importing this module registers `"moehal"`::

    import moehal.integrations.transformers  # noqa: F401  (registers experts_implementation="moehal")
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moehal")
    # or, on a loaded model: model.set_experts_implementation("moehal")

On an experts module's first call, moehal maps the flags to a `MoEConfig`, brings the weights
into its canonical layout once (transpose, de-interleave gate/up), infers the activation by
probing the module's own gate function against moehal's (silu, gelu, gpt-oss SwiGLU with the
module's alpha/limit), builds a `MoELayer` (selection happens here, once) and caches it on the
module. Later calls reuse it; if a weight is replaced or modified in place (its storage or
version counter changes) the layer is rebuilt, compiled graphs included (the custom op checks
the weights before it runs; a rebuilt layer of the same shape keeps its custom-op id).
Inference tensors (weights made under `torch.inference_mode()`) keep no version counter: an
in-place change of them goes unseen, so moehal warns (`UntrackedWeightsWarning`) and
`prepare(model, force=True)` rebuilds the layers after such a change. Layouts
moehal cannot express exactly raise `NotSupportedError` with the reason (post-expert norms,
expert-parallel sentinels, activations without a moehal equivalent); nothing silently falls
back.

`torch.compile`: the experts call becomes the `moehal::moe_forward` custom op (no graph break);
layers must be prepared before tracing, by one eager forward or by `prepare(model)`.

`register(name, backend=..., quant=...)` registers further variants, e.g. a forced backend or
moehal-side weight quantization (`quant="fp8_block"` quantizes the float weights once, at prepare).

For benchmarks, `peer_implementations()` lists transformers' own experts functions runnable
here and `experts_module(...)` builds a transformers-style experts module from canonical
weights with any layout flags, so they run on exactly the problem moehal runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from moehal.activations import apply_activation
from moehal.config import Activation, MoEConfig
from moehal.errors import MoEHalWarning, NotSupportedError, warn
from moehal.integrations import custom_op
from moehal.layer import MoELayer
from moehal.quant import QuantKind, QuantScheme
from moehal.weights import quantize_weights

__all__ = [
    "DEFAULT_NAME",
    "ExpertsLayout",
    "UntrackedWeightsWarning",
    "canonical_weights",
    "experts_module",
    "infer_activation",
    "moehal_experts_forward",
    "peer_callable",
    "peer_implementations",
    "prepare",
    "register",
]

DEFAULT_NAME = "moehal"
_STATE = "_moehal_state"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class ExpertsLayout:
    """The `@use_experts_implementation` flags of one experts module."""

    has_gate: bool = True
    is_concatenated: bool = True
    is_transposed: bool = False
    has_bias: bool = False
    has_post_expert_norm: bool = False

    @classmethod
    def of(cls, module: torch.nn.Module) -> ExpertsLayout:
        return cls(
            has_gate=bool(getattr(module, "has_gate", True)),
            is_concatenated=bool(getattr(module, "is_concatenated", True)),
            is_transposed=bool(getattr(module, "is_transposed", False)),
            has_bias=bool(getattr(module, "has_bias", False)),
            has_post_expert_norm=bool(getattr(module, "has_post_expert_norm", False)),
        )


# --- weights ----------------------------------------------------------------------------------


def _first_proj(module: torch.nn.Module, layout: ExpertsLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    name = "gate_up_proj" if layout.has_gate else "up_proj"
    w = getattr(module, name, None)
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise NotSupportedError(
            f"{type(module).__name__} has no 3-D `{name}` parameter; it is not a stacked-experts module"
        )
    b = getattr(module, f"{name}_bias", None) if layout.has_bias else None
    return w, b


def _odd(t: torch.Tensor, dim: int) -> torch.Tensor:
    idx = torch.arange(1, t.shape[dim], 2, device=t.device)
    return t.index_select(dim, idx)


def _even(t: torch.Tensor, dim: int) -> torch.Tensor:
    idx = torch.arange(0, t.shape[dim], 2, device=t.device)
    return t.index_select(dim, idx)


def canonical_weights(
    module: torch.nn.Module, layout: ExpertsLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(w13 `[E, N13, H]` as [gate; up], w2 `[E, H, I]`, w13_bias `[E, N13]`, w2_bias `[E, H]`),
    detached; views of the module's parameters where the layout already is canonical."""
    lay = layout or ExpertsLayout.of(module)
    w1, b1 = _first_proj(module, lay)
    w2 = getattr(module, "down_proj", None)
    if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        raise NotSupportedError(f"{type(module).__name__} has no 3-D `down_proj` parameter")
    b2 = getattr(module, "down_proj_bias", None) if lay.has_bias else None
    w1, w2 = w1.detach(), w2.detach()
    if lay.is_transposed:  # [E, in, out] -> [E, out, in]
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    if lay.has_gate and not lay.is_concatenated:
        w1 = torch.cat([_even(w1, 1), _odd(w1, 1)], dim=1)
        if b1 is not None:
            b1 = torch.cat([_even(b1.detach(), 1), _odd(b1.detach(), 1)], dim=1)
    b1 = b1.detach() if b1 is not None else None
    b2 = b2.detach() if b2 is not None else None
    return w1.contiguous(), w2.contiguous(), b1, b2


# --- activation -------------------------------------------------------------------------------


def _probe(n: int, device: torch.device) -> torch.Tensor:
    # Deterministic values of both signs: half over [-10, 10], half at magnitudes up to 1e3.
    # Clamps sit anywhere (gpt-oss 7, DeepSeek-V4 and GLM 10, Step 16): a probe that never
    # crosses one would take a clamped SwiGLU for plain SiLU. Large values stay exact in
    # float32 for every candidate (no overflow below ~88 in exp(-x) of the sigmoid's far side).
    g = torch.Generator().manual_seed(0)
    near = torch.rand(8, n, generator=g) * 20 - 10
    sign = torch.where(torch.rand(8, n, generator=g) < 0.5, -1.0, 1.0)
    far = sign * torch.pow(10.0, torch.rand(8, n, generator=g) * 3)  # |x| in [1, 1e3]
    return torch.cat([near, far]).to(device)


def infer_activation(module: torch.nn.Module, base: MoEConfig, layout: ExpertsLayout | None = None) -> MoEConfig:
    """`base` with the activation that reproduces the module's own gate/activation function.

    The module's function (its `_apply_gate` when gated, its `act_fn` when not) is run on a probe
    in its own layout and compared with each of moehal's activations; the first that matches in
    float32 wins. No match raises `NotSupportedError`, naming what was tried.
    """
    lay = layout or ExpertsLayout.of(module)
    n13 = base.w13_rows
    canon = _probe(n13, torch.device("cpu"))
    cands: list[MoEConfig] = []
    if lay.has_gate:
        alpha = float(getattr(module, "alpha", base.swiglu_alpha))
        limit = float(getattr(module, "limit", base.swiglu_limit))
        cands = [
            base.with_(activation=Activation.SILU, gated=True),
            base.with_(activation=Activation.GELU, gated=True),
            base.with_(activation=Activation.SWIGLU_OAI, gated=True, swiglu_alpha=alpha, swiglu_limit=limit),
        ]
        if lay.is_concatenated:
            theirs_in = canon
        else:
            half = n13 // 2
            theirs_in = torch.empty_like(canon)
            theirs_in[:, 0::2], theirs_in[:, 1::2] = canon[:, :half], canon[:, half:]
        fn: Callable[[torch.Tensor], torch.Tensor] = module._apply_gate
    else:
        cands = [base.with_(activation=a, gated=False) for a in (Activation.SILU, Activation.GELU)]
        theirs_in = canon
        fn = module.act_fn
    try:
        with torch.no_grad():
            theirs = fn(theirs_in).float()
    except Exception as exc:  # noqa: BLE001 - any failure means we cannot prove equivalence
        raise NotSupportedError(
            f"could not probe the activation of {type(module).__name__} ({type(exc).__name__}: {exc})"
        ) from exc
    for cfg in cands:
        ours = apply_activation(canon, cfg)
        if ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5):
            return cfg
    what = "_apply_gate" if lay.has_gate else f"act_fn ({type(module.act_fn).__name__})"
    raise NotSupportedError(
        f"the {what} of {type(module).__name__} matches none of moehal's activations "
        f"({', '.join(c.activation.value for c in cands)}"
        f"{', gated' if lay.has_gate else ', non-gated'}); use another experts_implementation for this model"
    )


# --- preparing and running --------------------------------------------------------------------


@dataclass
class _Prepared:
    key: tuple[Any, ...]
    layer: MoELayer

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        # A copy of the module (`copy.deepcopy`, pickle, `torch.save`) gets no layer: it builds
        # its own on its first eager forward. A copied layer kept the key of the original's
        # weights, and its custom-op id had no refresher, so a compiled copy ran stale weights.
        return _dropped, ()


def _dropped() -> None:
    return None


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors (created under torch.inference_mode) keep no version counter
        return -1


_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class UntrackedWeightsWarning(MoEHalWarning):
    """An experts module's weights are inference tensors: in-place changes of them go unseen
    (`prepare(model, force=True)` rebuilds the layers)."""


def _weight_key(module: torch.nn.Module, top_k: int, variant: tuple[str, str]) -> tuple[Any, ...]:
    parts: list[Any] = [top_k, variant]
    for name in _WEIGHT_NAMES:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            parts.append((name, t.data_ptr(), _version(t), tuple(t.shape), t.dtype, t.device))
    return tuple(parts)


def _build(module: torch.nn.Module, top_k: int, backend: str, quant: QuantScheme) -> MoELayer:
    lay = ExpertsLayout.of(module)
    name = type(module).__name__
    if lay.has_post_expert_norm:
        raise NotSupportedError(
            f"{name} normalizes each expert's output before weighting (has_post_expert_norm); moehal layers "
            "compute expert MLPs only: use experts_implementation='grouped_mm' or 'eager' for this model"
        )
    if getattr(module, "_is_expert_parallel", False):
        raise NotSupportedError(
            f"{name} runs under transformers' expert parallelism (sentinel expert ids); build moehal layers "
            "with MoEConfig(ep_rank=..., ep_size=...) and a process group instead"
        )
    w13, w2, b13, b2 = canonical_weights(module, lay)
    if w13.dtype not in _FLOAT_DTYPES:
        raise NotSupportedError(
            f"{name} holds {w13.dtype} weights; moehal's transformers integration takes bfloat16, float16 or "
            "float32 weights (it quantizes them itself with register(quant=...))"
        )
    e, n13, h = w13.shape
    i = w2.shape[2]
    if n13 != (2 * i if lay.has_gate else i) or tuple(w2.shape[:2]) != (e, h):
        raise NotSupportedError(f"{name}: inconsistent expert weight shapes {list(w13.shape)} and {list(w2.shape)}")
    base = MoEConfig(
        num_experts=e,
        top_k=top_k,
        hidden_size=h,
        intermediate_size=i,
        gated=lay.has_gate,
        has_w13_bias=b13 is not None,
        has_w2_bias=b2 is not None,
        dtype=w13.dtype,
    )
    cfg = infer_activation(module, base, lay)
    layer = MoELayer(cfg, quant, backend=backend, device=w13.device)
    with torch.no_grad():
        if quant.kind is QuantKind.BF16:
            layer.load_weights(w13=w13, w2=w2, **_biases(b13, b2))
        else:
            # (the module's own dtype: the quantizers upcast one expert at a time, where a float32
            # copy of the whole layer here came first)
            layer.load_weights(quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2))
    return layer


def _biases(b13: torch.Tensor | None, b2: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = {}
    if b13 is not None:
        out["w13_bias"] = b13
    if b2 is not None:
        out["w2_bias"] = b2
    return out


def _untracked_weights(module: torch.nn.Module) -> list[str]:
    """The module's weights that are inference tensors: they keep no version counter, so an
    in-place change of them leaves `_weight_key` as it was."""
    return [
        name
        for name in _WEIGHT_NAMES
        if isinstance(t := getattr(module, name, None), torch.Tensor) and t.is_inference()
    ]


# Builds and rebuilds of the modules' layers, one at a time: two threads that met one stale
# layer both rebuilt it, and the one stored last could hold a custom-op id the other's layer
# took over and released when it died (compiled graphs then named a layer that no longer existed).
_BUILD_LOCK = threading.RLock()


def _prepared(module: torch.nn.Module, top_k: int, backend: str, quant: QuantScheme, force: bool = False) -> _Prepared:
    key = _weight_key(module, top_k, (backend, quant.name))
    state: _Prepared | None = module.__dict__.get(_STATE)
    if state is not None and state.key == key and not force:
        return state  # (the forward's path: no lock)
    with _BUILD_LOCK:
        state = module.__dict__.get(_STATE)  # another thread may have built it meanwhile
        if state is not None and state.key == key and not force:
            return state
        if state is None and (untracked := _untracked_weights(module)):
            warn(
                f"{type(module).__name__}'s {', '.join(untracked)} are inference tensors (made under "
                "torch.inference_mode()), which keep no version counter: moehal sees a weight replaced, "
                "not one changed in place. After changing such weights in place, call "
                "moehal.integrations.transformers.prepare(model, force=True).",
                UntrackedWeightsWarning,
            )
        layer = _build(module, top_k, backend, quant)
        if state is not None and layer.config == state.layer.config and layer.quant == state.layer.quant:
            # the same layer with new weights: it keeps the old one's custom-op id, so graphs
            # compiled on it run the new weights
            custom_op.adopt_id(layer, state.layer._op_id)
        state = _Prepared(key, layer)
        module.__dict__[_STATE] = state  # a plain attribute: not a submodule, not in the state dict
        # compiled graphs call the custom op without this forward's eager check: the op checks
        # the weights first (a weak reference: the registry keeps no module alive)
        ref = weakref.ref(module)
        custom_op.set_refresher(layer._op_id, lambda: _refresh(ref, top_k, backend, quant))
        return state


def _refresh(ref: weakref.ReferenceType[torch.nn.Module], top_k: int, backend: str, quant: QuantScheme) -> None:
    module = ref()
    if module is not None:
        _prepared(module, top_k, backend, quant)


def _make_forward(backend: str, quant: QuantScheme) -> Callable[..., torch.Tensor]:
    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        if (
            self.training
            and torch.is_grad_enabled()
            and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters(recurse=False)))
        ):
            raise NotSupportedError(
                f"{type(self).__name__} is in training mode, and moehal's experts have no backward: no gradient "
                "would reach the experts, the router or the layers below. Call model.eval() (or run under "
                "torch.no_grad()) to serve, or train with experts_implementation='grouped_mm' or 'eager'"
            )
        if torch.compiler.is_compiling():
            state: _Prepared | None = self.__dict__.get(_STATE)
            if state is None:
                raise NotSupportedError(
                    f"{type(self).__name__} has no moehal layer yet: run one eager forward, or call "
                    "moehal.integrations.transformers.prepare(model), before torch.compile traces the model"
                )
        else:
            state = _prepared(self, int(top_k_index.shape[-1]), backend, quant)
        dtype = state.layer.config.dtype
        x = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)
        w = top_k_weights if top_k_weights.is_floating_point() else top_k_weights.float()
        if torch.compiler.is_compiling():
            x, w = (x.detach(), w.detach()) if torch.is_grad_enabled() else (x, w)  # (as custom_op.traced_forward)
            out = torch.ops.moehal.moe_forward(x, top_k_index, w, state.layer._op_id)
        else:
            out = state.layer(x, top_k_index, w)
        return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)

    forward.__name__ = forward.__qualname__ = "moehal_experts_forward"
    forward.__doc__ = f"transformers experts function running moehal (backend={backend!r}, quant={quant.name!r})."
    return forward


moehal_experts_forward = _make_forward("auto", QuantScheme.parse("bf16"))


def _float_checkpoint_scheme(quant: QuantScheme | str) -> QuantScheme:
    """The scheme moehal may quantize a float checkpoint into by itself: one whose activation
    scales are computed at run time. Schemes with static activation scales (fp8_tensor, nvfp4)
    would get placeholder scales here, which clip real hidden states (up to ~100% error)."""
    scheme = QuantScheme.parse(quant)
    if scheme.static_activation_scales:
        raise NotSupportedError(
            f"quant={scheme.name!r} uses static activation scales, which a float checkpoint does not carry "
            "and the transformers integration cannot calibrate; use quant='fp8_block' or 'w8a8_int8' (scaled "
            "at run time), or build a MoELayer with moehal.quantize_weights(..., calibration_input=...)"
        )
    return scheme


def register(name: str = DEFAULT_NAME, *, backend: str = "auto", quant: QuantScheme | str = "bf16") -> str:
    """Register moehal in transformers' `ALL_EXPERTS_FUNCTIONS` under `name`, selecting
    `backend` (`auto`: the best available) with weights in `quant` (`bf16`: the model's own
    float weights, unquantized). Returns `name`; registering a name again replaces it."""
    from transformers.integrations.moe import ExpertsInterface

    scheme = _float_checkpoint_scheme(quant)
    fn = moehal_experts_forward if (backend, scheme.name) == ("auto", "bf16") else _make_forward(backend, scheme)
    ExpertsInterface.register(name, fn)
    return name


def _is_experts_module(m: torch.nn.Module) -> bool:
    return hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and hasattr(m, "down_proj")


def prepare(
    model: torch.nn.Module,
    top_k: int | None = None,
    *,
    backend: str = "auto",
    quant: QuantScheme | str = "bf16",
    force: bool = False,
) -> int:
    """Build the moehal layer of every experts module in `model` now (selection and weight
    preparation outside any traced region). `top_k` defaults to each module's
    `config.num_experts_per_tok`. Use the same backend/quant as the registered name. Returns
    the number of modules prepared.

    `force=True` rebuilds layers whose weights look unchanged: after an in-place change of
    weights that are inference tensors (made under `torch.inference_mode()`), which keep no
    version counter for moehal to see the change by (`UntrackedWeightsWarning`)."""
    scheme = _float_checkpoint_scheme(quant)
    count = 0
    for m in model.modules():
        if not _is_experts_module(m):
            continue
        k = top_k if top_k is not None else getattr(getattr(m, "config", None), "num_experts_per_tok", None)
        if k is None:
            raise NotSupportedError(f"{type(m).__name__}: pass top_k=..., its config has no num_experts_per_tok")
        _prepared(m, int(k), backend, scheme, force)
        count += 1
    return count


# --- peers for benchmarks ---------------------------------------------------------------------


def peer_implementations(device: torch.device | str | None = None) -> dict[str, Callable[..., torch.Tensor]]:
    """transformers' own experts functions that can run on `device` (default: CPU), by name.

    grouped_mm and batched_mm are pure torch; deepgemm needs NVIDIA Hopper or newer and the
    DeepGEMM kernels; sonicmoe its own package. Empty when transformers is not installed."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return {}
    dev = torch.device(device) if device is not None else torch.device("cpu")
    out: dict[str, Callable[..., torch.Tensor]] = {}
    for name in ("grouped_mm", "batched_mm"):
        if name in ALL_EXPERTS_FUNCTIONS:
            out[name] = ALL_EXPERTS_FUNCTIONS[name]
    if dev.type == "cuda" and torch.version.cuda and torch.cuda.get_device_capability(dev)[0] >= 9:
        from moehal.hardware import module_available

        if "deepgemm" in ALL_EXPERTS_FUNCTIONS and (module_available("deep_gemm") or module_available("kernels")):
            out["deepgemm"] = ALL_EXPERTS_FUNCTIONS["deepgemm"]
    return out


def peer_callable(
    name: str, config: MoEConfig, w13: torch.Tensor, w2: torch.Tensor, device: torch.device | str
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`call(hidden, topk_ids, topk_weights)` running transformers' experts function `name` on
    canonical float weights (for `moehal bench`: the same problem, a peer implementation)."""
    fns = peer_implementations(device)
    if name not in fns:
        raise NotSupportedError(
            f"transformers experts implementation {name!r} cannot run here; available: {sorted(fns)}"
        )
    module = experts_module(config, w13.to(device, config.dtype), w2.to(device, config.dtype))
    fn = fns[name]
    return lambda x, ids, wts: fn(module, x, ids.long(), wts)


class _Experts(torch.nn.Module):
    """A transformers-style stacked experts module (what `@use_experts_implementation` sets up)."""

    def __init__(self, config: MoEConfig, layout: ExpertsLayout) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.has_gate, self.has_bias = layout.has_gate, layout.has_bias
        self.is_concatenated, self.is_transposed = layout.is_concatenated, layout.is_transposed
        self.has_post_expert_norm = False
        self._is_expert_parallel = False
        self._moehal_config = config
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        if config.activation is Activation.GELU:
            self.act_fn: torch.nn.Module = torch.nn.GELU()
        else:
            self.act_fn = torch.nn.SiLU()

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.is_concatenated:
            canon = gate_up
        else:
            canon = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
        return apply_activation(canon, self._moehal_config)


def experts_module(
    config: MoEConfig,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    layout: ExpertsLayout | None = None,
) -> torch.nn.Module:
    """A transformers-style experts module holding canonical float weights in `layout`
    (default: concatenated, not transposed), for running transformers' experts functions
    `fn(module, hidden, top_k_index, top_k_weights)` on a moehal problem."""
    lay = layout or ExpertsLayout(has_gate=config.gated, has_bias=w13_bias is not None or w2_bias is not None)
    m = _Experts(config, lay)
    first, down, b1 = w13, w2, w13_bias
    if lay.has_gate and not lay.is_concatenated:
        i = config.intermediate_size
        first = torch.stack([w13[:, :i], w13[:, i:]], dim=2).reshape(w13.shape)  # rows g0, u0, g1, u1, ...
        if b1 is not None:
            b1 = torch.stack([b1[:, :i], b1[:, i:]], dim=2).reshape(b1.shape)
    if lay.is_transposed:
        first, down = first.transpose(1, 2), down.transpose(1, 2)
    name = "gate_up_proj" if lay.has_gate else "up_proj"
    setattr(m, name, torch.nn.Parameter(first.contiguous(), requires_grad=False))
    m.down_proj = torch.nn.Parameter(down.contiguous(), requires_grad=False)
    if lay.has_bias:
        zeros13 = torch.zeros(w13.shape[0], w13.shape[1], dtype=w13.dtype, device=w13.device)
        zeros2 = torch.zeros(w2.shape[0], w2.shape[1], dtype=w2.dtype, device=w2.device)
        setattr(m, f"{name}_bias", torch.nn.Parameter(b1 if b1 is not None else zeros13, requires_grad=False))
        m.down_proj_bias = torch.nn.Parameter(w2_bias if w2_bias is not None else zeros2, requires_grad=False)
    return m


try:  # register on import when transformers is there; importing moehal never needs it
    import transformers.integrations.moe  # noqa: F401
except ImportError:  # pragma: no cover - exercised where transformers is absent
    pass
else:
    register()
