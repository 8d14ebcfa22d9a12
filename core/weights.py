"""Expert weights in moehal's canonical layout, their validation and reference quantization.

Canonical layout (what `MoELayer.load_weights` takes; E = local experts, N13 = 2I gated or I):

| field            | bf16         | fp8_block                | fp8_tensor | nvfp4                  | w8a8_int8   |
|------------------|--------------|--------------------------|------------|------------------------|-------------|
| w13 `[E,N13,H]`  | dtype        | e4m3                     | e4m3       | uint8 `[E,N13,H/2]`    | int8        |
| w2  `[E,H,I]`    | dtype        | e4m3                     | e4m3       | uint8 `[E,H,I/2]`      | int8        |
| w13_scale        | -            | fp32 `[E,N13/128,H/128]` | fp32 `[E]` | e4m3 `[E,N13,H/16]`    | fp32 `[E,N13]` |
| w2_scale         | -            | fp32 `[E,H/128,I/128]`   | fp32 `[E]` | e4m3 `[E,H,I/16]`      | fp32 `[E,H]`   |
| w13/w2_global_scale | -         | -                        | -          | fp32 `[E]`             | -           |
| a13/a2_scale     | -            | -                        | fp32 `[]`  | fp32 `[]` (global)     | -           |

(`/128` rounds up.) Biases: w13_bias `[E,N13]`, w2_bias `[E,H]`, any float dtype.
DeepSeek-V3 routing: correction_bias `[E_global]`.
Dequantized weight = q * scale (fp8, int8); e2m1(q) * block_scale / global_scale (nvfp4).
Activation scales: fp8_tensor a*_scale multiplies (x ~= q * a_scale); nvfp4 a*_scale is the
activation's global scale (see `moehal.quant.nvfp4`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import torch
from moehal.config import MoEConfig
from moehal.errors import WeightError
from moehal.quant import QuantKind, QuantScheme, ScaleFormat, fp8, int8, nvfp4

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's local expert weights (see the module docstring for shapes)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> ExpertWeights:
        moved = {
            f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None)
            for f in fields(self)
        }
        return ExpertWeights(**moved)

    def replace(self, **changes: torch.Tensor | None) -> ExpertWeights:
        return replace(self, **changes)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def expected_shapes(
    config: MoEConfig, quant: QuantScheme
) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
    """Field name -> (shape, allowed dtypes) for every tensor this config needs."""
    e, h, i, n13 = config.num_local_experts, config.hidden_size, config.intermediate_size, config.w13_rows
    k = quant.kind
    spec: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]] = {}
    if k is QuantKind.BF16:
        spec["w13"] = ((e, n13, h), (config.dtype,))
        spec["w2"] = ((e, h, i), (config.dtype,))
    elif k in (QuantKind.FP8_BLOCK, QuantKind.FP8_TENSOR):
        spec["w13"] = ((e, n13, h), (fp8.FP8_DTYPE,))
        spec["w2"] = ((e, h, i), (fp8.FP8_DTYPE,))
        if k is QuantKind.FP8_BLOCK:
            b = fp8.BLOCK
            spec["w13_scale"] = ((e, math.ceil(n13 / b), math.ceil(h / b)), (torch.float32,))
            spec["w2_scale"] = ((e, math.ceil(h / b), math.ceil(i / b)), (torch.float32,))
        else:
            spec["w13_scale"] = ((e,), (torch.float32,))
            spec["w2_scale"] = ((e,), (torch.float32,))
            spec["a13_scale"] = ((), (torch.float32,))
            spec["a2_scale"] = ((), (torch.float32,))
    elif k is QuantKind.NVFP4:
        v = nvfp4.SF_VEC
        spec["w13"] = ((e, n13, h // 2), (torch.uint8,))
        spec["w2"] = ((e, h, i // 2), (torch.uint8,))
        spec["w13_scale"] = ((e, n13, h // v), (torch.float8_e4m3fn,))
        spec["w2_scale"] = ((e, h, i // v), (torch.float8_e4m3fn,))
        spec["w13_global_scale"] = ((e,), (torch.float32,))
        spec["w2_global_scale"] = ((e,), (torch.float32,))
        spec["a13_scale"] = ((), (torch.float32,))
        spec["a2_scale"] = ((), (torch.float32,))
    elif k is QuantKind.W8A8_INT8:
        spec["w13"] = ((e, n13, h), (torch.int8,))
        spec["w2"] = ((e, h, i), (torch.int8,))
        spec["w13_scale"] = ((e, n13), (torch.float32,))
        spec["w2_scale"] = ((e, h), (torch.float32,))
    if config.has_w13_bias:
        spec["w13_bias"] = ((e, n13), _FLOATS)
    if config.has_w2_bias:
        spec["w2_bias"] = ((e, h), _FLOATS)
    if config.routing is not None and config.routing.has_correction_bias:
        spec["correction_bias"] = ((config.num_experts,), _FLOATS)
    return spec


def validate(weights: ExpertWeights, config: MoEConfig, quant: QuantScheme, device: torch.device) -> None:
    """Raise `WeightError` naming the first tensor that is missing, extra, or malformed."""
    spec = expected_shapes(config, quant)
    present = weights.tensors()
    for name, t in present.items():
        if not isinstance(t, torch.Tensor):
            raise WeightError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    for name, (shape, dtypes) in spec.items():
        t = present.get(name)
        if t is None:
            why = (
                "RoutingConfig(has_correction_bias=True) needs"  # the routing's, not the scheme's
                if name == "correction_bias"
                else f"{quant.name} weights need"
            )
            raise WeightError(f"{why} `{name}` with shape {list(shape)}; it was not given")
        if tuple(t.shape) != shape:
            hint = " (load only this rank's local experts)" if t.dim() and config.ep_size > 1 else ""
            raise WeightError(
                f"`{name}` has shape {list(t.shape)}, expected {list(shape)} for {config.describe()}{hint}"
            )
        if t.dtype not in dtypes:
            raise WeightError(
                f"`{name}` has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]} for {quant.name}"
            )
        # the index too where the layer has one: a layer on cuda:0 must not take weights on
        # cuda:1 (kernels would fault, or read them across the bus)
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            raise WeightError(f"`{name}` is on {t.device}, the layer is on {device}; move it first")
    extra = sorted(set(present) - set(spec))
    if extra:
        raise WeightError(f"unexpected tensors for {quant.name} with this config: {extra}")
    if quant.kind is QuantKind.NVFP4:
        if config.hidden_size % 16 or config.intermediate_size % 16:
            raise WeightError("nvfp4 needs hidden_size and intermediate_size to be multiples of 16")
        _check_nvfp4_global_scales(present)


def _check_nvfp4_global_scales(present: dict[str, torch.Tensor]) -> None:
    """moehal's nvfp4 global scale divides (`x = e2m1 * block / global`): 448 * 6 / amax, about
    1e3 to 1e5 for real weights. ModelOpt checkpoints store its reciprocal (`weight_scale_2`,
    about 1e-4), which given as it is runs silently wrong by a factor of 1e8 or so. A weight
    global scale below 1 would mean |w| > 2688: refused as that mix-up. (Activation global
    scales are not checked: activations that large are rare, not impossible.)"""
    for name in ("w13_global_scale", "w2_global_scale"):
        g = present[name]
        if g.numel() and not bool(((g >= 1) & torch.isfinite(g)).all()):  # load time: one read is fine
            raise WeightError(
                f"`{name}` holds {float(g.min()):g}: moehal's nvfp4 global scale divides (x = e2m1 * block_scale / "
                "global_scale, 448 * 6 / amax, finite and at least 1 for any real weight). A ModelOpt checkpoint's "
                "`weight_scale_2` is its reciprocal: pass 1 / weight_scale_2 (and 1 / input_scale as the activation "
                "global scale)"
            )


def quantize_weights(
    config: MoEConfig,
    quant: QuantScheme | str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    calibration_input: torch.Tensor | None = None,
) -> ExpertWeights:
    """Reference quantization of float weights into the canonical layout of `quant` (a
    `QuantScheme` or its name, e.g. "fp8_block").

    Static activation scales (fp8_tensor, nvfp4) are calibrated from `calibration_input`
    `[T, H]` if given (activations of the second GEMM are estimated from a bf16 pass), else
    set for unit-scale data: placeholders, which clip real hidden states. To load a quantized
    checkpoint, keep its own scales (`from_per_expert`; the user guide maps them).
    """
    quant = QuantScheme.parse(quant)
    k = quant.kind
    if k is QuantKind.NVFP4 and (w13.shape[-1] % nvfp4.SF_VEC or w2.shape[-1] % nvfp4.SF_VEC):
        raise WeightError(
            f"nvfp4 packs blocks of {nvfp4.SF_VEC} along K: hidden size {w13.shape[-1]} and intermediate "
            f"size {w2.shape[-1]} must both be multiples of {nvfp4.SF_VEC}"
        )
    extra: dict[str, torch.Tensor | None] = {
        "w13_bias": w13_bias,
        "w2_bias": w2_bias,
        "correction_bias": correction_bias,
    }
    if k is QuantKind.BF16:
        return ExpertWeights(w13.to(config.dtype), w2.to(config.dtype), **extra)
    a_amax, a2_amax = _calibrate(config, w13, calibration_input, w13_bias)
    if k is QuantKind.FP8_BLOCK:
        ue8m0 = quant.scale_format is ScaleFormat.UE8M0
        q13, s13 = _by_expert(lambda w, e: fp8.quantize_block(w, ue8m0), w13)
        q2, s2 = _by_expert(lambda w, e: fp8.quantize_block(w, ue8m0), w2)
        return ExpertWeights(q13, q2, s13, s2, **extra)
    if k is QuantKind.FP8_TENSOR:
        q13, s13 = _by_expert(lambda w, e: _fp8_per_tensor(w), w13)
        q2, s2 = _by_expert(lambda w, e: _fp8_per_tensor(w), w2)
        return ExpertWeights(
            q13,
            q2,
            s13,
            s2,
            a13_scale=torch.tensor(a_amax / fp8.FP8_MAX, device=w13.device),
            a2_scale=torch.tensor(a2_amax / fp8.FP8_MAX, device=w13.device),
            **extra,
        )
    if k is QuantKind.NVFP4:
        g13 = torch.stack([nvfp4.global_scale_for(w) for w in w13]) if len(w13) else torch.ones(0, device=w13.device)
        g2 = torch.stack([nvfp4.global_scale_for(w) for w in w2]) if len(w2) else torch.ones(0, device=w2.device)
        q13, s13 = _by_expert(lambda w, e: nvfp4.quantize(w, g13[e]), w13)
        q2, s2 = _by_expert(lambda w, e: nvfp4.quantize(w, g2[e]), w2)
        full = nvfp4.E4M3_MAX * nvfp4.E2M1_MAX
        return ExpertWeights(
            q13,
            q2,
            s13,
            s2,
            g13,
            g2,
            torch.tensor(full / a_amax, device=w13.device),
            torch.tensor(full / a2_amax, device=w13.device),
            **extra,
        )
    q13, s13 = _by_expert(lambda w, e: int8.quantize_per_channel(w), w13)
    q2, s2 = _by_expert(lambda w, e: int8.quantize_per_channel(w), w2)
    return ExpertWeights(q13, q2, s13, s2, **extra)


def _by_expert(
    quantize: Callable[[torch.Tensor, slice], tuple[torch.Tensor, torch.Tensor]], w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize(w[e:e+1], e)` for each expert, into one allocation per result. Every scheme's
    quantization is per expert, so this is the whole call's result bit for bit, and its float32
    temporaries are one expert's, not the layer's (several float32 copies of a whole layer: 11x
    the fp8 result at the peak, where engines quantize every layer at load)."""
    if w.shape[0] == 0:
        return quantize(w, slice(0, 0))
    q = s = None
    for e in range(w.shape[0]):
        qe, se = quantize(w[e : e + 1], slice(e, e + 1))
        if q is None or s is None:
            q = qe.new_empty((w.shape[0], *qe.shape[1:]))
            s = se.new_empty((w.shape[0], *se.shape[1:]))
        q[e : e + 1].copy_(qe)
        s[e : e + 1].copy_(se)
    assert q is not None and s is not None
    return q, s


def _fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[E, N, K]` -> e4m3 and one fp32 scale per expert `[E]`."""
    s = w.float().abs().amax(dim=(1, 2)).clamp_min(1e-12) / fp8.FP8_MAX
    return (w.float() / s[:, None, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE), s


def _calibrate(
    config: MoEConfig, w13: torch.Tensor, x: torch.Tensor | None, w13_bias: torch.Tensor | None
) -> tuple[float, float]:
    """Amax (with 25% headroom) of the first GEMM's input and of the second's (the activation of
    `x @ w13^T + w13_bias`, every expert); unit-scale placeholders without `x`."""
    if x is None or x.numel() == 0:
        return 4.0, 4.0
    from moehal.activations import apply_activation

    a_amax = float(x.float().abs().amax().clamp_min(1e-6))
    h = torch.einsum("th,enh->etn", x.float(), w13.float())
    if w13_bias is not None:
        h = h + w13_bias.float()[:, None, :]
    a2 = apply_activation(h, config)
    return a_amax * 1.25, float(a2.abs().amax().clamp_min(1e-6)) * 1.25


def dequantize_weights(weights: ExpertWeights, quant: QuantScheme | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dequantization to float32 `(w13, w2)` in the canonical layout; `quant` a
    scheme or its name, as `quantize_weights` takes it."""
    quant = QuantScheme.parse(quant)
    k = quant.kind
    if k is QuantKind.BF16:
        return weights.w13.float(), weights.w2.float()
    needed = ("w13_scale", "w2_scale") + (("w13_global_scale", "w2_global_scale") if k is QuantKind.NVFP4 else ())
    missing = [n for n in needed if getattr(weights, n) is None]
    if missing:
        raise WeightError(f"{quant.name} weights need {', '.join(needed)} to dequantize; missing: {', '.join(missing)}")
    assert weights.w13_scale is not None and weights.w2_scale is not None  # for the type checker
    if k is QuantKind.FP8_BLOCK:
        return fp8.dequantize_block(weights.w13, weights.w13_scale), fp8.dequantize_block(weights.w2, weights.w2_scale)
    if k is QuantKind.FP8_TENSOR:
        return (
            weights.w13.float() * weights.w13_scale[:, None, None].float(),
            weights.w2.float() * weights.w2_scale[:, None, None].float(),
        )
    if k is QuantKind.NVFP4:
        assert weights.w13_global_scale is not None and weights.w2_global_scale is not None  # checked above
        return (
            nvfp4.dequantize(weights.w13, weights.w13_scale, weights.w13_global_scale),
            nvfp4.dequantize(weights.w2, weights.w2_scale, weights.w2_global_scale),
        )
    return int8.dequantize_rows(weights.w13, weights.w13_scale), int8.dequantize_rows(weights.w2, weights.w2_scale)


def local_slice(global_weights: ExpertWeights, config: MoEConfig) -> ExpertWeights:
    """Cut this rank's experts out of a checkpoint holding all experts."""
    sl = slice(config.local_expert_start, config.local_expert_start + config.num_local_experts)
    per_expert = {"w13", "w2", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "w13_bias", "w2_bias"}
    changes = {n: t[sl] for n, t in global_weights.tensors().items() if n in per_expert}
    return global_weights.replace(**changes)


def from_per_expert(
    gate: Sequence[torch.Tensor] | None,
    up: Sequence[torch.Tensor],
    down: Sequence[torch.Tensor],
    *,
    gate_scale: Sequence[torch.Tensor] | None = None,
    up_scale: Sequence[torch.Tensor] | None = None,
    down_scale: Sequence[torch.Tensor] | None = None,
    gate_global_scale: Sequence[torch.Tensor] | None = None,
    up_global_scale: Sequence[torch.Tensor] | None = None,
    down_global_scale: Sequence[torch.Tensor] | None = None,
    gate_bias: Sequence[torch.Tensor] | None = None,
    up_bias: Sequence[torch.Tensor] | None = None,
    down_bias: Sequence[torch.Tensor] | None = None,
    **extra: torch.Tensor,
) -> ExpertWeights:
    """The canonical weights from a checkpoint that stores each expert's projections apart, as
    HF and vLLM checkpoints do (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`; Mixtral's
    `w1`, `w3`, `w2`): one tensor per local expert, in expert order.

    gate, up: `[I, H]` each (gate None: a non-gated MLP, whose `up` is its first projection);
    down: `[H, I]`. Scales in moehal's convention (the user guide's table says how checkpoints
    map to it): a dequantized fp8 or int8 weight is `q * scale`, so a DeepSeek/vLLM
    `weight_scale_inv` goes in as it is, despite its name. Row scales (fp8_block's
    `[I/128, H/128]`, int8's `[I]`, nvfp4's `[I, H/16]`) are stacked gate-then-up.

    Where w13 holds one scale for both halves and the checkpoint has two that differ, the half
    with the finer scale is requantized to the coarser one: fp8_tensor's per-expert scales (the
    fp8 weights are rescaled and rounded again, as vLLM's `requantize_with_max_scale` does), and
    nvfp4's global scales (`*_global_scale`, one per expert: `1 / weight_scale_2` of a ModelOpt
    checkpoint; the e4m3 block scales are rescaled and rounded again, where vLLM keeps the
    gate's global and warns). `extra`: the other `ExpertWeights`
    fields (activation scales, `correction_bias`), as they are."""
    e = len(down)
    for name, seq in (("gate", gate), ("up", up)):
        if seq is not None and len(seq) != e:
            raise WeightError(f"{name} has {len(seq)} experts, down has {e}")
    inter = up[0].shape[0] if e else 0
    if gate is not None and gate_scale is not None and e and inter % 128 and gate_scale[0].dim() == 2:
        if gate_scale[0].shape[0] == -(-inter // 128) != inter:  # 128-row blocks, I not a multiple of 128
            raise WeightError(
                f"block scales of gate and up ({inter} rows each) cannot stack into w13's 128-row blocks: "
                "a block would straddle the two halves. Requantize with moehal.quantize_weights"
            )
    for name in ("w13_global_scale", "w2_global_scale"):
        if name in extra:
            raise WeightError(f"pass {name} per projection (gate_/up_/down_global_scale), not as {name}=")
    w13_global = None
    if gate_global_scale is not None or up_global_scale is not None:
        if up_global_scale is None or (gate is not None) != (gate_global_scale is not None):
            raise WeightError("give gate_global_scale and up_global_scale together (up_global_scale alone: no gate)")
        if up_scale is None or (gate is not None and gate_scale is None):
            raise WeightError("global scales come with their projections' block scales (gate_scale, up_scale)")
        if gate is not None:
            assert gate_scale is not None and gate_global_scale is not None  # checked just above
            gate_scale, up_scale, w13_global = _shared_global_scales(
                gate_scale, up_scale, gate_global_scale, up_global_scale
            )
        else:
            w13_global = torch.stack([g.reshape(()) for g in up_global_scale]).float()
    elif gate is not None and gate_scale is not None and up_scale is not None:
        gate, up, gate_scale, up_scale = _shared_tensor_scales(gate, up, gate_scale, up_scale)
    try:
        if gate is not None:
            w13 = _stack_experts([(g, u) for g, u in zip(gate, up, strict=True)], "w13")
        else:
            w13 = _stack_experts([(u,) for u in up], "w13")
        w2 = _stack_experts([(d,) for d in down], "w2")
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:  # gate and up of other widths, no experts
        raise WeightError(f"the per-expert tensors do not stack into w13 and w2: {exc}") from None
    w13_scale = _stack_halves("scale", gate_scale, up_scale, gate is not None)
    w13_bias = _stack_halves("bias", gate_bias, up_bias, gate is not None)
    if w13_global is not None:
        extra["w13_global_scale"] = w13_global
    if down_global_scale is not None:
        extra["w2_global_scale"] = torch.stack([g.reshape(()) for g in down_global_scale]).float()
    return ExpertWeights(
        w13=w13,
        w2=w2,
        w13_scale=w13_scale,
        w2_scale=torch.stack(list(down_scale)) if down_scale is not None else None,
        w13_bias=w13_bias,
        w2_bias=torch.stack(list(down_bias)) if down_bias is not None else None,
        **extra,
    )


def _shared_tensor_scales(
    gate: Sequence[torch.Tensor],
    up: Sequence[torch.Tensor],
    gate_s: Sequence[torch.Tensor],
    up_s: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """fp8 per-tensor gate and up scales that differ -> both halves on the larger one: the half
    with the smaller scale is dequantized and rounded again (vLLM's requantize_with_max_scale).
    Other scales (rows, blocks) pass through."""
    gate, up, gate_s, up_s = list(gate), list(up), list(gate_s), list(up_s)
    if len(gate_s) != len(gate) or len(up_s) != len(up):
        raise WeightError(f"{len(gate_s)} gate and {len(up_s)} up scales for {len(gate)} experts")
    for i, (g, u, gs, us) in enumerate(zip(gate, up, gate_s, up_s, strict=True)):
        if gs.numel() != 1 or us.numel() != 1 or torch.equal(gs.reshape(()), us.reshape(())):
            continue
        if g.dtype != fp8.FP8_DTYPE or u.dtype != fp8.FP8_DTYPE:
            raise WeightError(
                f"expert {i}: gate and up scales {float(gs):g} and {float(us):g} differ, and w13 takes one per "
                f"expert; only {fp8.FP8_DTYPE} weights are requantized to the larger here, these are {g.dtype}"
            )
        top = torch.maximum(gs.reshape(()).float(), us.reshape(()).float())
        gate[i], up[i] = (_fp8_rescaled(w, s.reshape(()).float() / top) for w, s in ((g, gs), (u, us)))
        gate_s[i] = up_s[i] = top
    return gate, up, gate_s, up_s


def _fp8_rescaled(w: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """e4m3 weights times ratio <= 1, rounded again (no saturation: |w * ratio| <= |w|)."""
    return w if bool(ratio == 1) else (w.float() * ratio).to(fp8.FP8_DTYPE)


def _shared_global_scales(
    gate_s: Sequence[torch.Tensor],
    up_s: Sequence[torch.Tensor],
    gate_g: Sequence[torch.Tensor],
    up_g: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """nvfp4 gate and up global scales (`x = e2m1 * block / global`) -> one per expert, the
    smaller (ModelOpt's larger `weight_scale_2`), with the other half's e4m3 block scales
    multiplied by global / own global (<= 1) and rounded again. The e2m1 values stay. This is
    faithful to the checkpoint; vLLM's ModelOpt loader instead keeps the gate's global and warns
    when the two differ (reconciling them was proposed upstream, vllm #55073 and #56095)."""
    if not len(gate_s) == len(up_s) == len(gate_g) == len(up_g):
        raise WeightError(
            f"{len(gate_s)} gate and {len(up_s)} up block scales, {len(gate_g)} gate and {len(up_g)} up global scales"
        )
    gate_out, up_out, shared = [], [], []
    for gs, us, gg, ug in zip(gate_s, up_s, gate_g, up_g, strict=True):
        g, u = gg.reshape(()).float(), ug.reshape(()).float()
        low = torch.minimum(g, u)
        gate_out.append(gs if bool(g == low) else (gs.float() * (low / g)).to(gs.dtype))
        up_out.append(us if bool(u == low) else (us.float() * (low / u)).to(us.dtype))
        shared.append(low)
    return gate_out, up_out, torch.stack(shared) if shared else torch.ones(0)


def _stack_experts(parts: Sequence[tuple[torch.Tensor, ...]], name: str) -> torch.Tensor:
    """Each expert's parts, one after the other along their rows, stacked over experts into one
    allocation: `torch.stack` of per-expert `torch.cat`s held every expert's concatenation at
    once beside the result (2.3x a layer's weights at its peak, against 2x here; an engine loads
    every layer of a checkpoint so). Parts must agree in dtype, device and all but their rows."""
    if not parts:
        raise ValueError("no experts")
    first = parts[0][0]
    rows = sum(p.shape[0] for p in parts[0])
    out = torch.empty((len(parts), rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for e, expert in enumerate(parts):
        r = 0
        for p in expert:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name} of expert {e}: {type(p).__name__}, not a tensor")
            if p.dtype != out.dtype or p.device != out.device or p.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"{name} of expert {e}: {p.dtype} {list(p.shape)} on {p.device}, expert 0's parts are "
                    f"{out.dtype} [*, {', '.join(map(str, first.shape[1:]))}] on {out.device}"
                )
            if r + p.shape[0] > rows:
                raise ValueError(f"{name} of expert {e} has more rows than expert 0's {rows}")
            out[e, r : r + p.shape[0]].copy_(p)
            r += p.shape[0]
        if r != rows:
            raise ValueError(f"{name} of expert {e} has {r} rows, expert 0's {rows}")
    return out


def _stack_halves(
    what: str, gate: Sequence[torch.Tensor] | None, up: Sequence[torch.Tensor] | None, gated: bool
) -> torch.Tensor | None:
    if up is None:
        if gate is not None:
            raise WeightError(f"gate_{what} given without up_{what}")
        return None
    if not gated:
        if gate is not None:
            raise WeightError(f"gate_{what} given for a non-gated MLP (gate is None)")
        return torch.stack(list(up))
    if gate is None:
        raise WeightError(f"up_{what} given without gate_{what}")
    rows = []
    for i, (g, u) in enumerate(zip(gate, up, strict=True)):
        if g.numel() == 1 and u.numel() == 1:  # one scale per expert: w13 holds one for both halves
            if not torch.equal(g.reshape(()), u.reshape(())):
                raise WeightError(
                    f"expert {i}: gate_{what} {float(g):g} and up_{what} {float(u):g} differ, and w13 takes one "
                    "per expert"
                )
            rows.append(g.reshape(()))
        else:
            rows.append(torch.cat([g, u]))
    return torch.stack(rows)
