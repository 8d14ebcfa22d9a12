"""The reference expert MLP: dequantized weights, activations quantized as the scheme says.

Roundings follow what an unfused kernel stores: GEMM1 output and the activation output are
rounded to the layer dtype (bf16 kernels keep these intermediates in bf16), then quantized
for GEMM2 per the scheme. Arithmetic is float32. Kernels round elsewhere within tolerance:
vLLM's and SGLang's activation kernels also round `act(gate)` to bf16 before the product
with `up` (1-2 bf16 ulp on about a quarter of outputs), and kernels that fuse the activation
into GEMM1's epilogue never round GEMM1's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moehal.activations import apply_activation
from moehal.config import MoEConfig
from moehal.quant import QuantKind, QuantScheme, ScaleFormat, fp8, int8, nvfp4
from moehal.weights import ExpertWeights, dequantize_weights


@dataclass(frozen=True)
class DequantizedWeights:
    w13: torch.Tensor  # fp32 [E, N13, H]
    w2: torch.Tensor  # fp32 [E, H, I]
    b13: torch.Tensor | None  # fp32 [E, N13]
    b2: torch.Tensor | None  # fp32 [E, H]
    a13_scale: torch.Tensor | None
    a2_scale: torch.Tensor | None


def dequantize_for_reference(weights: ExpertWeights, quant: QuantScheme) -> DequantizedWeights:
    w13, w2 = dequantize_weights(weights, quant)
    b13 = weights.w13_bias.float() if weights.w13_bias is not None else None
    b2 = weights.w2_bias.float() if weights.w2_bias is not None else None
    return DequantizedWeights(w13, w2, b13, b2, weights.a13_scale, weights.a2_scale)


def quantize_dequantize(x: torch.Tensor, quant: QuantScheme, static_scale: torch.Tensor | None) -> torch.Tensor:
    """What the kernel's GEMM sees of activation `x` (float32, any leading shape)."""
    k = quant.kind
    if k is QuantKind.BF16:
        return x
    if k is QuantKind.FP8_BLOCK:
        return fp8.qdq_group(x, ue8m0=quant.scale_format is ScaleFormat.UE8M0)
    if k is QuantKind.FP8_TENSOR:
        assert static_scale is not None
        return fp8.qdq_tensor(x, static_scale)
    if k is QuantKind.NVFP4:
        assert static_scale is not None
        return nvfp4.qdq(x, static_scale)
    return int8.qdq_per_token(x)


def expert_mlp(
    x: torch.Tensor,
    w: DequantizedWeights,
    experts: int | slice,
    config: MoEConfig,
    quant: QuantScheme,
    input_is_quantized: bool,
) -> torch.Tensor:
    """Run expert(s) on float32 rows.

    experts: an int (x is `[N, H]`) or a slice of experts (x is `[E_sel, M, H]`).
    input_is_quantized: x was already (de)quantized by the dispatcher for this scheme.
    """
    dtype = config.dtype
    xq = x if input_is_quantized else quantize_dequantize(x, quant, w.a13_scale)
    w13, w2 = w.w13[experts], w.w2[experts]
    if isinstance(experts, int):
        h = xq @ w13.t()
        if w.b13 is not None:
            h = h + w.b13[experts]
    else:
        h = torch.einsum("emh,enh->emn", xq, w13)
        if w.b13 is not None:
            h = h + w.b13[experts][:, None, :]
    a = apply_activation(h.to(dtype).float(), config).to(dtype).float()
    aq = quantize_dequantize(a, quant, w.a2_scale)
    if isinstance(experts, int):
        y = aq @ w2.t()
        if w.b2 is not None:
            y = y + w.b2[experts]
    else:
        y = torch.einsum("emi,ehi->emh", aq, w2)
        if w.b2 is not None:
            y = y + w.b2[experts][:, None, :]
    return y
