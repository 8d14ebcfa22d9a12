"""NVFP4 checkpoints on Hopper: weights unpacked to BF16 once at load, grouped BF16 GEMMs, and
the scheme's NVFP4 activation quantization reproduced in the Triton glue (the GEMM1 input and
the activation, with the checkpoint's static global scales), so results match the nvfp4
reference, not a bf16 one.

Every GEMM operand is NVFP4 codes times their e4m3 block scales (`nvfp4.block_values`), which
bf16 holds exactly; the global scales (per expert for weights, static for activations) are
applied to each GEMM's fp32 accumulator before its one rounding (`out_scale` of the Triton
grouped GEMMs). Dividing by them first, as this path did until session 49, rounded every
dequantized value to bf16 on its own: those roundings are shared by every value of one code,
so they did not average out, and flipped codes of the activation's quantization. NVFP4 layers
came out 2.5-3% from the reference on average, and up to 11% on a one-token layer, where the
reference itself is 0.25% from the float64 loop (docs/device-runs/2026-11-28-session49).
DeepGEMM's grouped GEMMs write bf16 only, so its output would be rounded before the scale: that
double rounding moved a quarter of GEMM1's outputs by one step, as far off. Hence the Triton
GEMMs here (`moehal.kernels.triton_grouped_gemm`), masked and contiguous, on DeepGEMM's layouts.

Costs: weights take 4x the memory of FP4 (BF16), and the GEMMs run at the BF16 rate of untuned
Triton tiles. It is a compatibility path: on SM100 the FlashInfer CuteDSL NVFP4 experts (FP4
tensor cores) win.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.formats import ContiguousInput, ContiguousOutput, MaskedInput, MaskedOutput
from moehal.interfaces import BuildRequest, ExpertsRunner, TunedShape, WeightProcessor
from moehal.quant import NVFP4, nvfp4
from moehal.weights import ExpertWeights
from moehal_cuda.deepgemm_experts import (
    MASKED_ROW_ALIGNMENT,
    DeepGemmExperts,
    DeepGemmExpertsRunner,
    DeepGemmOps,
    DeepGemmWeights,
    check_masked_rows,
)
from moehal_cuda.support import claim_deep_gemm_device

LAYOUT = "deepgemm_nvfp4_dequant"


@dataclass
class DequantNvfp4Weights(DeepGemmWeights):
    """w13 / w2: `nvfp4.block_values` in bf16 (exact). The activations' static global scales,
    and each GEMM's output factor per expert: 1 / (activation global scale x the expert's
    weight global scale), fp32 `[E]`."""

    a13_global_scale: torch.Tensor | None = None  # fp32 [] on device
    a2_global_scale: torch.Tensor | None = None
    w13_out_scale: torch.Tensor | None = None  # fp32 [E]
    w2_out_scale: torch.Tensor | None = None


def out_scale(activation_scale: torch.Tensor, weight_scales: torch.Tensor) -> torch.Tensor:
    """fp32 `[E]` factors 1 / (a x w[e]), computed in float64 and rounded once."""
    return (1.0 / (activation_scale.double().reshape(()) * weight_scales.double())).float().contiguous()


def dequantize_nvfp4_weights(weights: ExpertWeights, dtype: torch.dtype) -> DequantNvfp4Weights:
    assert weights.w13_scale is not None and weights.w2_scale is not None
    assert weights.w13_global_scale is not None and weights.w2_global_scale is not None
    assert weights.a13_scale is not None and weights.a2_scale is not None
    w13 = torch.stack([nvfp4.block_values(q, s).to(dtype) for q, s in zip(weights.w13, weights.w13_scale)])
    w2 = torch.stack([nvfp4.block_values(q, s).to(dtype) for q, s in zip(weights.w2, weights.w2_scale)])
    b13 = weights.w13_bias.float().contiguous() if weights.w13_bias is not None else None
    b2 = weights.w2_bias.float().contiguous() if weights.w2_bias is not None else None
    a13 = weights.a13_scale.float().reshape(())
    a2 = weights.a2_scale.float().reshape(())
    return DequantNvfp4Weights(
        w13.contiguous(), w2.contiguous(), None, None, b13, b2, a13_global_scale=a13, a2_global_scale=a2,
        w13_out_scale=out_scale(a13, weights.w13_global_scale), w2_out_scale=out_scale(a2, weights.w2_global_scale),
    )  # fmt: skip


class Nvfp4DequantProcessor(WeightProcessor):
    """NVFP4 (packed e2m1 + e4m3 block scales + global scales) -> BF16 codes x block scales and
    per-expert output factors, once."""

    name = "nvfp4_dequant_weights"
    layout = LAYOUT
    priority = 10
    devices = frozenset({"cuda"})
    quant_schemes = frozenset({NVFP4})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        return dequantize_nvfp4_weights(weights, req.config.dtype)


class Nvfp4DequantRunner(DeepGemmExpertsRunner):
    def load(self, weights: Any) -> None:
        if isinstance(weights, ExpertWeights):
            weights = dequantize_nvfp4_weights(weights, self.config.dtype)
        self.w = weights

    def apply(self, inp: Any) -> Any:
        from moehal.kernels.triton_permute import contiguous_workspace, workspace
        from moehal_cuda.triton_glue import RowIndex, activation, add_bias, nvfp4_qdq_rows

        w = self.w
        assert isinstance(w, DequantNvfp4Weights) and w.a13_global_scale is not None
        if inp.hidden.numel() == 0:
            return self._empty_output(inp)
        c = self.config
        tag = f"{c.w13_rows}:{c.intermediate_size}:{c.hidden_size}"
        if isinstance(inp, MaskedInput):
            e, m, h = inp.hidden.shape
            check_masked_rows(m)
            lead: tuple[int, ...] = (e, m)
            rows = RowIndex(e * m, m, masked_m=inp.masked_m, total_rows=inp.total_rows_bound)
        elif isinstance(inp, ContiguousInput):
            lead = (inp.hidden.shape[0],)
            h = inp.hidden.shape[1]
            rows = RowIndex(lead[0], 0, row_expert=inp.row_expert, segment_start=inp.segment_start, counts=inp.counts)
        else:
            raise TypeError(f"NVFP4-dequant experts cannot take {type(inp).__name__}")
        if len(lead) == 2:
            xq = workspace(f"dgq.x:{tag}", lead, h, c.dtype, inp.hidden.device, False).hidden
        else:  # as the GEMM buffers: this call's rows of one buffer (`DeepGemmExpertsRunner._buffers`)
            cap = self.contiguous_capacity(lead[0])
            xq = contiguous_workspace(f"dgq.x:{tag}", lead[0], cap, h, c.dtype, inp.hidden.device, False).hidden
        nvfp4_qdq_rows(inp.hidden, xq, w.a13_global_scale, rows)
        hb, ab, yb = self._buffers(lead, inp.hidden.device)
        self._gemm(inp, xq, w.w13, hb.hidden, w.w13_out_scale)
        activation(hb.hidden, ab, yb.hidden, rows, c, w.w13_bias, False, w.a2_global_scale)
        self._gemm(inp, ab.hidden, w.w2, yb.hidden, w.w2_out_scale)
        if w.w2_bias is not None:
            add_bias(yb.hidden, w.w2_bias, rows)
        return MaskedOutput(yb.hidden) if isinstance(inp, MaskedInput) else ContiguousOutput(yb.hidden)

    def _gemm(self, inp: Any, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None) -> None:
        """out = (a @ w[e]^T) x scale[e] per live row, rounded once (see the module's docstring)."""
        from moehal.kernels.triton_grouped_gemm import contiguous_grouped_gemm, masked_grouped_gemm

        if isinstance(inp, MaskedInput):
            masked_grouped_gemm(a, None, w, None, out, inp.masked_m, inp.total_rows_bound, out_scale=scale)
        else:
            contiguous_grouped_gemm(a, w, out, inp.row_expert, self.fmt.row_alignment, out_scale=scale)


class Nvfp4DequantExperts(DeepGemmExperts):
    """NVFP4 on SM90: BF16 grouped GEMMs on weights unpacked at load, the global scales in the
    GEMMs' fp32 epilogues; activations quantized to NVFP4 in the glue so the numerics follow the
    scheme. The name is the component's id since session 13: it takes DeepGEMM's layouts and
    buffers, and since session 49 Triton's GEMMs (module docstring)."""

    name = "deepgemm_nvfp4_dequant"
    priority = 15  # below native FP4 kernels (CuteDSL on SM100)
    description = (
        "NVFP4 weights unpacked to BF16 once + BF16 Triton grouped GEMMs with the global scales in their "
        "epilogues; NVFP4 activation quantization in the glue"
    )
    quant_schemes = frozenset({NVFP4})
    weight_layout: ClassVar[str] = LAYOUT

    def check_quant(self, req: BuildRequest) -> Decision:
        if req.quant != NVFP4:
            return decline(f"quant {req.quant.name} is not nvfp4", "quant")
        return accept(predicate="quant")

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.dtype != torch.bfloat16:
            return decline(f"these experts compute in bf16; the layer dtype is {c.dtype}", "shape")
        for name, v in (("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size)):
            if v % 64:
                return decline(f"{name}={v} must be a multiple of 64 (the grouped GEMMs' 64-wide K tiles)", "shape")
        return accept(predicate="shape")

    def tuned_shapes(self, req: BuildRequest) -> Sequence[TunedShape]:
        """None: the same GEMMs at every size (no table, no small batch format), the code
        conformance's small shapes run."""
        return ()

    def input_formats(self, req: BuildRequest) -> list[Any]:
        from moehal.formats import ActivationFormat, Layout

        masked = ActivationFormat(Layout.MASKED, req.config.dtype, row_alignment=MASKED_ROW_ALIGNMENT)
        contig = ActivationFormat(Layout.CONTIGUOUS, req.config.dtype, row_alignment=self._alignment())
        mt = req.config.max_tokens
        return [masked, contig] if mt is not None and mt <= 512 else [contig, masked]

    def build(self, req: BuildRequest, fmt: Any) -> ExpertsRunner:
        claim_deep_gemm_device(req)
        return Nvfp4DequantRunner(req, fmt, DeepGemmOps(False, (req.hardware.sm or 0) >= 100))
