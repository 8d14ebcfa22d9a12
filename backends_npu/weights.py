"""Weight processors: canonical moehal weights -> the layouts the Ascend kernels read.

Canonical (see `moehal.weights`): w13 `[E, 2I, H]` = [gate; up], w2 `[E, H, I]`, W8A8 scales
fp32 `[E, 2I]` / `[E, H]`. Each processor runs once, in `process_weights_after_loading`.

- `npu_gmm` (grouped-matmul experts; vllm-ascend `AscendW8A8DynamicFusedMoEMethod` layout):
  w13 -> `[E, H, 2I]`, w2 -> `[E, I, H]` (x @ W form), NZ cast; scales fp32 `[E, N]`.
- `npu_fuseep_fused_deep_moe` (FuseMode.FUSED_DEEP_MOE): as above, plus gmm1's columns (and
  their scales) tile-permuted: every 128 columns hold 64 gate then 64 up columns, which is
  how the fused kernel's SwiGLU epilogue reads them; scales fp32.
- `npu_fuseep_dispatch_ffn_combine` (FuseMode.DISPATCH_FFN_COMBINE): w13 `[E, H, 2I]`,
  w2 `[E, I, H]`, NZ cast, scales as int64 holding the float32 bit pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moehal.interfaces import BuildRequest, WeightProcessor
from moehal.quant import BF16, W8A8_INT8, QuantKind
from moehal.weights import ExpertWeights
from moehal_npu.common import NpuImplementation, vendor_ops

GMM_LAYOUT = "npu_gmm"
FUSED_DEEP_MOE_LAYOUT = "npu_fuseep_fused_deep_moe"
DISPATCH_FFN_COMBINE_LAYOUT = "npu_fuseep_dispatch_ffn_combine"
W13_TILE = 128


@dataclass(frozen=True)
class NpuWeights:
    """Kernel-layout weights. w13 `[E, H, 2I]`, w2 `[E, I, H]` (`[E, H, I]` for FUSED_DEEP_MOE),
    NZ on hardware; scales `[E, 2I]` / `[E, H]`: fp32 (w2's bf16 for the grouped-matmul experts,
    int64 bit patterns for DISPATCH_FFN_COMBINE), None for BF16 experts."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None


def permute_w13_columns(t: torch.Tensor, tile: int = W13_TILE) -> torch.Tensor:
    """`[..., 2I]` as [gate | up] -> tile-interleaved: column c*tile + s*tile/2 + r takes
    original column s*I + c*tile/2 + r (s = 0 gate, 1 up). Needs 2I % tile == 0."""
    *dims, n = t.shape
    if n % tile:
        raise ValueError(f"2I={n} must be a multiple of {tile} for the FUSED_DEEP_MOE gmm1 layout")
    return t.reshape(*dims, 2, n // tile, tile // 2).transpose(-3, -2).reshape(*dims, n)


def float_bits_as_int64(scale: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 holding its IEEE bit pattern (sign-extended int32), the scale dtype of
    DISPATCH_FFN_COMBINE (DeepEP-Ascend FUSED_DEEP_MOE.md, "Scale tensor dtype")."""
    return scale.float().contiguous().view(torch.int32).to(torch.int64)


def _gemm_layout(weights: ExpertWeights, req: BuildRequest) -> tuple[torch.Tensor, torch.Tensor]:
    ops = vendor_ops(req)
    w13 = ops.format_cast_nz(weights.w13.transpose(1, 2).contiguous())
    w2 = ops.format_cast_nz(weights.w2.transpose(1, 2).contiguous())
    return w13, w2


class _NpuProcessor(NpuImplementation, WeightProcessor):
    """Processors follow their kernel's declarations; they add only the hardware, library and dtype checks."""


class GmmWeights(_NpuProcessor):
    name = "gmm_weights"
    layout = GMM_LAYOUT
    priority = 20
    description = "w13 -> [E,H,2I], w2 -> [E,I,H], NZ cast; scales [E,N]: w13's fp32, w2's bf16"
    quant_schemes = frozenset({BF16, W8A8_INT8})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> NpuWeights:
        w13, w2 = _gemm_layout(weights, req)
        if req.quant.kind is QuantKind.BF16:
            return NpuWeights(w13, w2, None, None)
        assert weights.w13_scale is not None and weights.w2_scale is not None
        # w13's scale feeds npu_dequant_swiglu_quant, which takes fp32. w2's scale feeds the
        # second grouped matmul, whose int8 path on Atlas A2/A3 pairs a bf16 output with a bf16
        # scale (fp32 with fp16 output); layers here are bf16 (`check_dtype`), as in vllm-ascend.
        s2 = weights.w2_scale.to(torch.bfloat16).contiguous()
        return NpuWeights(w13, w2, weights.w13_scale.float().contiguous(), s2)


class FusedDeepMoeWeights(_NpuProcessor):
    name = "fused_deep_moe_weights"
    layout = FUSED_DEEP_MOE_LAYOUT
    priority = 20
    description = "FUSED_DEEP_MOE: w13 -> [E,H,2I] tile-permuted, scale permute; w2 [E,H,I] as is; NZ cast"
    quant_schemes = frozenset({W8A8_INT8})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> NpuWeights:
        ops = vendor_ops(req)
        w13 = ops.format_cast_nz(permute_w13_columns(weights.w13.transpose(1, 2)).contiguous())
        # gmm2 stays [E, H, I], as the documentation's example, DeepEP-Ascend's test and SGLang's
        # FuseEP weights hold it (NZ cast only)
        w2 = ops.format_cast_nz(weights.w2.contiguous())
        assert weights.w13_scale is not None and weights.w2_scale is not None
        s13, s2 = weights.w13_scale.float(), weights.w2_scale.float()
        return NpuWeights(w13, w2, permute_w13_columns(s13).contiguous(), s2.contiguous())


class DispatchFfnCombineWeights(_NpuProcessor):
    name = "dispatch_ffn_combine_weights"
    layout = DISPATCH_FFN_COMBINE_LAYOUT
    priority = 20
    description = "DISPATCH_FFN_COMBINE: w13 -> [E,H,2I], w2 -> [E,I,H], NZ cast, int64-bit scales"
    quant_schemes = frozenset({W8A8_INT8})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> NpuWeights:
        w13, w2 = _gemm_layout(weights, req)
        assert weights.w13_scale is not None and weights.w2_scale is not None
        return NpuWeights(w13, w2, float_bits_as_int64(weights.w13_scale), float_bits_as_int64(weights.w2_scale))
