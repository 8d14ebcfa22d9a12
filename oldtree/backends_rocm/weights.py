"""AITER's weight processor (the Triton one is shared: `moehal.kernels.triton_experts`)."""

from __future__ import annotations

from typing import Any, ClassVar

from moehal.capability import Decision, accept, decline
from moehal.interfaces import BuildRequest, WeightProcessor
from moehal.kernels.triton_experts import _fp32, fp8_is_fnuz, to_fnuz
from moehal.quant import BF16, FP8_BLOCK, W8A8_INT8, QuantKind, QuantScheme
from moehal.weights import ExpertWeights

AITER_LAYOUT = "aiter_moe"


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
        if kind is QuantKind.FP8_BLOCK and fp8_is_fnuz(req.hardware):
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
