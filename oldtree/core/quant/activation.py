"""Activation (de)quantization for the dispatched formats (`formats.ScaleKind`).

Works on any leading shape: `[T, H]`, `[M, H]` or `[E, M, H]`. Zero rows (padding)
quantize to zero and stay zero.
"""

from __future__ import annotations

import torch
from moehal.capability import Decision, accept, decline
from moehal.formats import ActivationFormat, Layout, ScaleKind
from moehal.quant import fp8, int8


def quantize_activation(
    x: torch.Tensor, kind: ScaleKind, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, scales) of `x` in `kind`'s format. STATIC_TENSOR quantizes with `static_scale` (fp32,
    one element) and lays the scales out as GROUP_128's, that scale in every group."""
    if kind is ScaleKind.NONE:
        return x, None
    if kind in (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0):
        return fp8.quantize_group(x, ue8m0=kind is ScaleKind.GROUP_128_UE8M0)
    if kind is ScaleKind.STATIC_TENSOR:
        if static_scale is None:
            raise ValueError("static_tensor quantization needs the layer's static input scale")
        q, s = fp8.quantize_tensor(x, static_scale.reshape(()))
        groups = fp8.num_blocks(x.shape[-1])
        return q, s.float().expand(*x.shape[:-1], groups).contiguous()
    if kind is ScaleKind.PER_TOKEN:
        return int8.quantize_per_token(x)
    raise ValueError(f"no reference quantizer for scale kind {kind}")


def dequantize_activation(q: torch.Tensor, scales: torch.Tensor | None, kind: ScaleKind) -> torch.Tensor:
    """To float32."""
    if kind is ScaleKind.NONE or scales is None:
        return q.float()
    if kind in (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0, ScaleKind.STATIC_TENSOR):
        return fp8.dequantize_group(q, scales)
    if kind is ScaleKind.PER_TOKEN:
        return int8.dequantize_rows(q, scales)
    raise ValueError(f"no reference dequantizer for scale kind {kind}")


def scale_kind_dtype(kind: ScaleKind) -> torch.dtype | None:
    """The activation dtype a scale kind implies."""
    if kind in (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0, ScaleKind.STATIC_TENSOR):
        return fp8.FP8_DTYPE
    if kind is ScaleKind.PER_TOKEN:
        return torch.int8
    return None


def check_core_format(fmt: ActivationFormat, layer_dtype: torch.dtype) -> Decision:
    """Whether a dispatcher that permutes with moehal's torch helpers and quantizes with the
    reference quantizers can emit `fmt`: a core layout, unquantized in the layer dtype, or
    fp8 group-128 / int8 per-token."""
    if not isinstance(fmt.layout, Layout):
        return decline(f"layout {fmt.layout_name!r} is not a core layout", "format")
    if fmt.scales is ScaleKind.NONE:
        if fmt.dtype != layer_dtype:
            return decline(f"unquantized dispatch keeps the layer dtype {layer_dtype}, not {fmt.dtype}", "format")
        return accept(predicate="format")
    if fmt.scales is ScaleKind.STATIC_TENSOR:
        # the static scale arrives with the weights; the quantize adapter takes it there
        return decline("quantizes with dynamic scales only; static_tensor goes through the quantize adapter", "format")
    want = scale_kind_dtype(fmt.scales)
    if want is None or fmt.dtype != want:
        return decline(f"scales {fmt.scales.value} need dtype {want}, got {fmt.dtype}", "format")
    return accept(predicate="format")
