"""AMD AITER fused MoE (`aiter.fused_moe.fused_moe`), when `aiter` is importable on MI300/MI350.

Written against the API in ROCm/aiter `aiter/fused_moe.py :: fused_moe(hidden_states, w1, w2,
topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu,
quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, ...)`, where w1 is
`[E_local, 2I, H]` ([gate; up]), w2 `[E_local, H, I]`, topk_ids are ids into `expert_mask`
(`[E]`, 1 for the experts this rank holds) and the result is the weighted sum `[T, H]`.

NOT RUN: no AMD GPU was available when this was written. It is gated on the hardware
(gfx942/gfx950), on `aiter` importing with the symbols used here, and on shapes the CK/ASM
kernels tile (H, I multiples of 128); anything else is declined with the reason, and the
Triton kernels take it. docs/backends/rocm.md has the command that verifies it on an AMD GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.config import Activation
from moehal.formats import ActivationFormat, Layout, StandardInput, StandardOutput
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner
from moehal.kernels.host import dense_aligned
from moehal.quant import BF16, FP8_BLOCK, W8A8_INT8, QuantKind, QuantScheme
from moehal_rocm import hw as rocm_hw
from moehal_rocm.weights import AITER_LAYOUT

_REQUIRED = ("ActivationType", "QuantType")  # at the package's top level (`aiter.ops.enum`)


def _fused_moe() -> Any:
    """AITER's `fused_moe` function. It lives in the `aiter.fused_moe` submodule, which
    `import aiter` does not load: `aiter.fused_moe` is absent in a fresh process, and the
    module (not the function) once vLLM or SGLang has imported it. Imported as they do."""
    from aiter.fused_moe import fused_moe

    return fused_moe


class AiterExpertsRunner(ExpertsRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        import aiter

        self.aiter = aiter
        self.fused_moe = _fused_moe()
        self.fmt = fmt
        c = req.config
        self.e = c.num_local_experts
        self.activation = aiter.ActivationType.Silu if c.activation is Activation.SILU else aiter.ActivationType.Gelu
        qt = aiter.QuantType
        self.quant_type = {
            QuantKind.BF16: qt.No,
            QuantKind.FP8_BLOCK: qt.per_128x128,
            QuantKind.W8A8_INT8: qt.per_Token,
        }[req.quant.kind]
        # EP: STANDARD gives local ids with -1 for remote experts, and padded slots are -1 too
        # (MoEConfig.topk_padding). AITER filters experts through expert_mask, so those slots go
        # to one extra, masked-out id E_local.
        self.expert_mask = None
        if c.ep_size > 1 or c.topk_padding:
            mask = torch.ones(self.e + 1, dtype=torch.int32, device=req.device)
            mask[-1] = 0
            self.expert_mask = mask
        self.w: dict[str, Any] | None = None

    def load(self, weights: Any) -> None:
        self.w = weights

    def apply(self, inp: Any) -> Any:
        assert self.w is not None, "weights not loaded"
        assert isinstance(inp, StandardInput)
        if inp.hidden.shape[0] == 0:  # an EP rank that received no tokens (SGLang skips AITER here too)
            return StandardOutput(inp.hidden.new_zeros(inp.hidden.shape))
        ids = inp.topk_ids
        if self.expert_mask is not None:
            ids = torch.where(ids < 0, torch.full_like(ids, self.e), ids)
        # dense operands: AITER's kernels take pointers, and its Python layer documents no
        # strides (the caller's hidden_states may be a view of wider rows, its top-k column-major)
        out = self.fused_moe(
            dense_aligned(inp.hidden),
            self.w["w13"],
            self.w["w2"],
            inp.topk_weights.float().contiguous(),
            ids.to(torch.int32).contiguous(),
            expert_mask=self.expert_mask,
            activation=self.activation,
            quant_type=self.quant_type,
            w1_scale=self.w["w13_scale"],
            w2_scale=self.w["w2_scale"],
        )
        return StandardOutput(out)


class AiterExperts(Experts):
    """AITER's fused MoE (ASM one-stage or CK two-stage kernels, chosen by AITER)."""

    name = "aiter"
    priority = 30
    description = "AMD AITER fused_moe (CK/ASM kernels; bf16, fp8 block scale, int8 per-token) on MI300/MI350"
    devices: ClassVar[frozenset[str]] = frozenset({"rocm"})
    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset({BF16, FP8_BLOCK, W8A8_INT8})
    activations: ClassVar[frozenset[Activation]] = frozenset({Activation.SILU, Activation.GELU})
    supports_non_gated = False
    supports_bias = False
    weight_layout: ClassVar[str] = AITER_LAYOUT
    graph_capturable = False  # not verified on hardware: claim nothing
    # CK's second stage adds the top-k rows into the output atomically, in no fixed order
    deterministic = False

    def check_hardware(self, req: BuildRequest) -> Decision:
        d = super().check_hardware(req)
        if not d.ok:
            return d
        arch = req.hardware.arch
        if arch not in rocm_hw.AITER_ARCHS:
            return decline(f"AITER's MoE kernels target {list(rocm_hw.AITER_ARCHS)}; this GPU is {arch}", "hardware")
        return accept(predicate="hardware")

    def check_libraries(self, req: BuildRequest) -> Decision:
        if not rocm_hw.module_available("aiter"):
            return decline(
                "AMD AITER is not installed (pip install from https://github.com/ROCm/aiter); "
                "the Triton kernels are used instead",
                "libraries",
            )
        try:
            import aiter
        except Exception as exc:  # noqa: BLE001 - a broken install declines, it does not crash
            return decline(f"aiter is installed but fails to import ({type(exc).__name__}: {exc})", "libraries")
        missing = [n for n in _REQUIRED if not hasattr(aiter, n)]
        try:
            _fused_moe()
        except Exception:  # noqa: BLE001 - an older layout, or a submodule that fails to import
            missing.append("aiter.fused_moe.fused_moe")
        if missing or not hasattr(aiter.QuantType, "per_128x128"):
            version = rocm_hw.aiter_version() or "unknown version"
            return decline(
                f"this aiter ({version}) lacks {missing or ['QuantType.per_128x128']}; "
                "moehal needs the fused_moe API of 2025 or later",
                "libraries",
            )
        return accept(f"aiter {rocm_hw.aiter_version() or '(source build)'}", "libraries")

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.dtype not in (torch.bfloat16, torch.float16):
            return decline(f"AITER computes in bf16/fp16, not {c.dtype}", "shape")
        if c.dtype == torch.float16 and req.quant.kind is not QuantKind.BF16:
            # AITER's quantized MoE kernels are keyed on bf16 output (fused_moe.py's
            # fused_moe_1stage_dict; asm_stage1 "only support bf16"): fp16 untested anywhere here
            return decline(
                f"AITER's {req.quant.name} MoE kernels write bf16; an fp16 layer runs the Triton fused MoE", "shape"
            )
        if c.hidden_size % 128 or c.intermediate_size % 128:
            return decline("AITER's MoE kernels need hidden and intermediate sizes that are multiples of 128", "shape")
        return accept(predicate="shape")

    def check_quant(self, req: BuildRequest) -> Decision:
        d = super().check_quant(req)
        if d.ok and req.quant.kind is QuantKind.W8A8_INT8 and req.hardware.arch == "gfx950":
            # int8 takes AITER's ASM stage 1 (fused_moe.py get_2stage_cfgs), whose per-token int8
            # kernels ship for gfx942 only (hsa/gfx942/fmoe_2stages): "not find kernel" at the
            # first forward on gfx950. vLLM and SGLang send int8 MoE to Triton, as moehal then does.
            return decline("AITER ships no per-token int8 MoE kernel for gfx950; the Triton fused MoE runs it", "quant")
        return d

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        return [ActivationFormat(Layout.STANDARD, req.config.dtype)]  # AITER quantizes inside

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return AiterExpertsRunner(req, fmt)
