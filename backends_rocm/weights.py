"""Weight processors of the ROCm backend: canonical weights -> what each kernel reads."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.interfaces import BuildRequest, WeightProcessor
from moehal.quant import BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, W8A8_INT8, QuantKind, QuantScheme, ScaleFormat
from moehal.weights import ExpertWeights
from moehal_rocm import hw as rocm_hw

TRITON_LAYOUT = "triton_fused_moe"
AITER_LAYOUT = "aiter_moe"
_KERNEL_QUANT = {QuantKind.BF16: "none", QuantKind.FP8_BLOCK: "fp8_block", QuantKind.W8A8_INT8: "int8"}


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.float().contiguous() if t is not None else None


def to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn weights -> e4m3fnuz for MI300 (same bits, scale x2, -0 -> +0); lossless.
    The vLLM/SGLang ROCm paths normalize checkpoints the same way."""
    bits = q.view(torch.int8)
    bits = torch.where(bits == -128, torch.zeros_like(bits), bits)
    return bits.view(torch.float8_e4m3fnuz).contiguous(), (scale.float() * 2.0).contiguous()


class TritonWeightProcessor(WeightProcessor):
    """Canonical weights -> `moehal.kernels.triton_fused_moe.TritonMoEWeights`.

    The kernel reads the canonical `[E, N, K]` layout as is; this converts fp8 to the
    hardware's flavour (e4m3fnuz on MI300) and biases to fp32. The CUDA backend registers its
    own instance (`TritonWeightProcessor(devices=frozenset({'cuda'}))`) so that its Triton
    experts do not depend on this plugin being loaded.
    """

    name = "triton_weights"
    layout = TRITON_LAYOUT
    priority = 20
    description = "canonical -> Triton fused-MoE weights (fp8 e4m3fn -> e4m3fnuz on MI300)"
    devices: ClassVar[frozenset[str]] = frozenset({"rocm", "cpu"})
    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset({BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, W8A8_INT8})

    def __init__(self, devices: frozenset[str] | None = None) -> None:
        if devices is not None:
            self.devices = frozenset(devices)  # type: ignore[misc]

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        from moehal.kernels.triton_fused_moe import TritonMoEWeights

        kind = req.quant.kind
        w13, w2, s13, s2 = weights.w13, weights.w2, weights.w13_scale, weights.w2_scale
        if kind is QuantKind.FP8_BLOCK and rocm_hw.fp8_is_fnuz(req.hardware):
            assert s13 is not None and s2 is not None
            w13, s13 = to_fnuz(w13, s13)
            w2, s2 = to_fnuz(w2, s2)
        return TritonMoEWeights(
            w13=w13.contiguous(),
            w2=w2.contiguous(),
            quant=_KERNEL_QUANT[kind],
            w13_scale=_fp32(s13),
            w2_scale=_fp32(s2),
            w13_bias=_fp32(weights.w13_bias),
            w2_bias=_fp32(weights.w2_bias),
            ue8m0=req.quant.scale_format is ScaleFormat.UE8M0,
        )


class AiterWeightProcessor(WeightProcessor):
    """Canonical weights -> AITER's layout: fp8 as e4m3fnuz on gfx942, rows shuffled into
    16x16 tiles with `aiter.ops.shuffle.shuffle_weight`, per-channel scales as `[E, N, 1]`.
    NOT RUN: no AMD GPU was available when this was written (see docs/backends/rocm.md)."""

    name = "aiter_weights"
    layout = AITER_LAYOUT
    priority = 30
    description = "canonical -> AITER fused_moe weights (shuffled 16x16, fnuz on gfx942)"
    devices: ClassVar[frozenset[str]] = frozenset({"rocm"})
    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset({BF16, FP8_BLOCK, W8A8_INT8})

    def check_libraries(self, req: BuildRequest) -> Decision:
        try:
            from aiter.ops.shuffle import shuffle_weight  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure declines
            return decline(f"aiter.ops.shuffle.shuffle_weight is not importable ({type(exc).__name__}: {exc})")
        return accept(predicate="libraries")

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        from aiter.ops.shuffle import shuffle_weight

        kind = req.quant.kind
        w13, w2, s13, s2 = weights.w13, weights.w2, weights.w13_scale, weights.w2_scale
        if kind is QuantKind.FP8_BLOCK and rocm_hw.fp8_is_fnuz(req.hardware):
            assert s13 is not None and s2 is not None
            w13, s13 = to_fnuz(w13, s13)
            w2, s2 = to_fnuz(w2, s2)
        if kind is QuantKind.W8A8_INT8:
            assert s13 is not None and s2 is not None
            s13, s2 = s13.float().unsqueeze(-1).contiguous(), s2.float().unsqueeze(-1).contiguous()
        return {
            "w13": shuffle_weight(w13.contiguous(), layout=(16, 16)),
            "w2": shuffle_weight(w2.contiguous(), layout=(16, 16)),
            "w13_scale": _fp32(s13),
            "w2_scale": _fp32(s2),
        }
