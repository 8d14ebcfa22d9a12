"""The reference experts: the oracle. Every scheme, activation, bias and layout, any device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    ScaleKind,
    StandardInput,
    StandardOutput,
)
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner
from moehal.quant import ALL_SCHEMES, QuantKind, QuantScheme, ScaleFormat
from moehal.quant.activation import dequantize_activation
from moehal.reference.math import DequantizedWeights, dequantize_for_reference, expert_mlp


def dispatch_quant_formats(quant: QuantScheme, layout: Layout, dtype: torch.dtype) -> list[ActivationFormat]:
    """Formats for a scheme whose activations the dispatcher can quantize, best first:
    pre-quantized (fp8 1x128 groups, int8 per token), then unquantized."""
    out: list[ActivationFormat] = []
    if quant.kind is QuantKind.FP8_BLOCK:
        kind = ScaleKind.GROUP_128_UE8M0 if quant.scale_format is ScaleFormat.UE8M0 else ScaleKind.GROUP_128
        out.append(ActivationFormat(layout, torch.float8_e4m3fn, kind))
    elif quant.kind is QuantKind.W8A8_INT8:
        out.append(ActivationFormat(layout, torch.int8, ScaleKind.PER_TOKEN))
    out.append(ActivationFormat(layout, dtype))
    return out


class ReferenceExpertsRunner(ExpertsRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        self.fmt, self.config, self.quant = fmt, req.config, req.quant
        self.w: DequantizedWeights | None = None

    def load(self, weights: Any) -> None:
        self.w = dequantize_for_reference(weights, self.quant)

    def _input(self, hidden: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return dequantize_activation(hidden, scales, self.fmt.scales)

    def apply(self, inp: Any) -> Any:
        assert self.w is not None, "weights not loaded"
        c, pre = self.config, self.fmt.is_quantized
        if isinstance(inp, MaskedInput):
            x = self._input(inp.hidden, inp.scales)
            y = expert_mlp(x, self.w, slice(None), c, self.quant, pre)
            live = torch.arange(x.shape[1], device=x.device)[None, :] < inp.masked_m[:, None]
            return MaskedOutput(torch.where(live[..., None], y, 0.0).to(c.dtype))
        if isinstance(inp, ContiguousInput):
            x = self._input(inp.hidden, inp.scales)
            y = torch.zeros(x.shape[0], c.hidden_size, dtype=torch.float32, device=x.device)
            row = torch.arange(x.shape[0], device=x.device)
            expert = inp.row_expert.long()
            start = inp.segment_start.long()[expert.clamp(min=0)]
            live = (expert >= 0) & (row - start < inp.counts.long()[expert.clamp(min=0)])
            for e in range(c.num_local_experts):
                rows = torch.nonzero(live & (expert == e)).flatten()
                if rows.numel():
                    y[rows] = expert_mlp(x[rows], self.w, e, c, self.quant, pre)
            return ContiguousOutput(y.to(c.dtype))
        if isinstance(inp, StandardInput):
            x = self._input(inp.hidden, inp.scales)
            out = torch.zeros(x.shape[0], c.hidden_size, dtype=torch.float32, device=x.device)
            ids = inp.topk_ids.long()
            for e in range(c.num_local_experts):
                tok, kk = torch.nonzero(ids == e, as_tuple=True)
                if tok.numel():
                    y = expert_mlp(x[tok], self.w, e, c, self.quant, pre).to(c.dtype).float()
                    out.index_add_(0, tok, y * inp.topk_weights[tok, kk].float()[:, None])
            return StandardOutput(out.to(c.dtype))
        raise TypeError(f"reference experts cannot take {type(inp).__name__}")


class ReferenceExperts(Experts):
    """Dequantize-and-loop experts in float32: slow, exact, runs anywhere."""

    name = "experts"
    priority = 0
    description = "pure-torch oracle (float32 on dequantized weights)"
    quant_schemes = frozenset(ALL_SCHEMES)
    graph_capturable = False  # loops over experts with data-dependent row selection
    fallback = True

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        out: list[ActivationFormat] = []
        for layout in (Layout.STANDARD, Layout.CONTIGUOUS, Layout.MASKED):
            out.extend(dispatch_quant_formats(req.quant, layout, req.config.dtype))
        return out

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return ReferenceExpertsRunner(req, fmt)
