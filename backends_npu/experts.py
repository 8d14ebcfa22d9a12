"""Grouped-matmul experts on torch_npu: BF16 and W8A8 INT8 dynamic.

BF16:  npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul.
W8A8:  int8 rows with per-token scales (quantized by the dispatcher, as DeepEP-Ascend's
       low-latency dispatch does) -> npu_grouped_matmul (int32 accumulator) ->
       npu_dequant_swiglu_quant (dequant with per-channel weight and per-token activation
       scales, SwiGLU, dynamic per-token int8) -> npu_grouped_matmul with per-channel and
       per-token scales -> bf16. This is vllm-ascend's W8A8-dynamic MLP.

Formats consumed (best first): the plugin's flat low-latency layout `npu_ll_flat` (group
list as produced: cumulative ends or counts), CONTIGUOUS (alignment 1, counts, group list
type 1) and MASKED (each expert's max_m-row slab is one group: static cumulative ends
(e+1)*max_m, group list type 0; padding rows are zero in, masked to zero out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from moehal.capability import Decision, decline
from moehal.config import Activation
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    ScaleKind,
)
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner
from moehal.quant import BF16, W8A8_INT8, QuantKind
from moehal_npu.common import NPU_LL_FLAT, FlatInput, FlatOutput, NpuImplementation, vendor_ops
from moehal_npu.ops import DEQUANT_SWIGLU_ALIGN, DEQUANT_SWIGLU_MAX
from moehal_npu.weights import GMM_LAYOUT, NpuWeights


def activation_format(layout: Layout | str, req: BuildRequest) -> ActivationFormat:
    """What the NPU experts consume in `layout` for this scheme."""
    if req.quant.kind is QuantKind.W8A8_INT8:
        return ActivationFormat(layout, torch.int8, ScaleKind.PER_TOKEN)
    return ActivationFormat(layout, req.config.dtype)


def counts_from(group_list: torch.Tensor, group_list_type: int) -> torch.Tensor:
    """Per-group row counts int64 from either group-list convention (0 cumsum ends, 1 counts)."""
    gl = group_list.to(torch.int64)
    if group_list_type == 1:
        return gl
    return torch.diff(gl, prepend=gl.new_zeros(1))


class GmmExpertsRunner(ExpertsRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        self.fmt = fmt
        self.ops = vendor_ops(req)
        self.dtype = req.config.dtype
        self.num_local = req.config.num_local_experts
        self.quantized = req.quant.kind is QuantKind.W8A8_INT8
        self.w: NpuWeights | None = None

    def load(self, weights: Any) -> None:
        if not isinstance(weights, NpuWeights):
            raise TypeError(f"NPU grouped-matmul experts take NpuWeights (layout {GMM_LAYOUT}), got {type(weights)}")
        self.w = weights

    def mlp(
        self, x: torch.Tensor, scales: torch.Tensor | None, group_list: torch.Tensor, group_list_type: int
    ) -> torch.Tensor:
        """Rows `[M, H]` grouped by `group_list` -> `[M, H]` in the layer dtype (rows past the
        last group are unspecified: callers mask them)."""
        w, ops = self.w, self.ops
        assert w is not None, "weights not loaded"
        gl = group_list.to(torch.int64)
        if not self.quantized:
            h = ops.grouped_matmul(x, w.w13, gl, group_list_type, output_dtype=self.dtype)
            a = ops.swiglu(h)
            return ops.grouped_matmul(a, w.w2, gl, group_list_type, output_dtype=self.dtype)
        assert scales is not None and w.w13_scale is not None and w.w2_scale is not None
        acc = ops.grouped_matmul(x, w.w13, gl, group_list_type, output_dtype=torch.int32)
        aq, a_scale = ops.dequant_swiglu_quant(acc, w.w13_scale, scales.float(), counts_from(gl, group_list_type))
        return ops.grouped_matmul(
            aq, w.w2, gl, group_list_type, scale=w.w2_scale, per_token_scale=a_scale, output_dtype=self.dtype
        )

    def apply(self, inp: Any) -> Any:
        if isinstance(inp, FlatInput):
            m = inp.hidden.shape[0]
            total = counts_from(inp.group_list, inp.group_list_type).sum()
            y = self.mlp(inp.hidden, inp.scales, inp.group_list, inp.group_list_type)
            live = torch.arange(m, device=y.device) < total
            return FlatOutput(torch.where(live[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)))
        if isinstance(inp, ContiguousInput):
            y = self.mlp(inp.hidden, inp.scales, inp.counts, 1)
            live = inp.row_expert >= 0
            return ContiguousOutput(torch.where(live[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)))
        if isinstance(inp, MaskedInput):
            e, max_m, h = inp.hidden.shape
            ends = torch.arange(1, e + 1, dtype=torch.int64, device=inp.hidden.device) * max_m
            scales = inp.scales.reshape(e * max_m) if inp.scales is not None else None
            y = self.mlp(inp.hidden.reshape(e * max_m, h), scales, ends, 0).view(e, max_m, h)
            live = torch.arange(max_m, device=y.device)[None, :] < inp.masked_m[:, None]
            return MaskedOutput(torch.where(live[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device)))
        raise TypeError(f"NPU grouped-matmul experts cannot take {type(inp).__name__}")


class GmmExperts(NpuImplementation, Experts):
    """torch_npu grouped-matmul experts (BF16, W8A8 INT8 dynamic)."""

    name = "gmm"
    priority = 20
    description = "npu_grouped_matmul + npu_swiglu / npu_dequant_swiglu_quant (BF16, W8A8 INT8 dynamic)"
    quant_schemes = frozenset({BF16, W8A8_INT8})
    activations = frozenset({Activation.SILU})
    supports_non_gated = False
    supports_bias = False
    graph_capturable = True  # group lists stay on the device; every shape is static
    weight_layout = GMM_LAYOUT

    def check_activation(self, req: BuildRequest) -> Decision:
        d = super().check_activation(req)
        c = req.config
        if d.ok or (c.activation in self.activations and c.gated):  # a bias or weight-on-input decline
            return d
        return decline(
            f"{d.reason}: npu_swiglu and npu_dequant_swiglu_quant are SiLU-gated (SwiGLU) only", "activation"
        )

    def check_shape(self, req: BuildRequest) -> Decision:
        i = req.config.intermediate_size
        if req.quant.kind is QuantKind.W8A8_INT8 and (i > DEQUANT_SWIGLU_MAX or i % DEQUANT_SWIGLU_ALIGN):
            return decline(
                f"npu_dequant_swiglu_quant with group_index takes an output width (intermediate_size) <= "
                f"{DEQUANT_SWIGLU_MAX} and a multiple of {DEQUANT_SWIGLU_ALIGN}, not {i}",
                "shape",
            )
        return super().check_shape(req)

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        return [activation_format(layout, req) for layout in (NPU_LL_FLAT, Layout.CONTIGUOUS, Layout.MASKED)]

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return GmmExpertsRunner(req, fmt)
