"""FuseEP: DeepEP-Ascend's `Buffer.fused_deep_moe`, the whole layer in one kernel.

Routing result in, output out: dispatch, GMM1, dequant-SwiGLU-quant, GMM2, dequant and
combine run inside one AscendC kernel on a low-latency buffer. Two fuse modes, each an
ordinary `FusedForward` registration with the limits its own documentation states
(sgl-project/sgl-kernel-npu `python/deep_ep/doc/FUSED_DEEP_MOE.md`, and the FusedDeepMoe
tiling checks `csrc/deepep/ops/op_host/fused_deep_moe_tiling.cpp`):

- FuseMode.FUSED_DEEP_MOE (1, `aclnnFusedDeepMoe`): quant_mode 1, INT8 weights (the op's
  definition, `csrc/deepep/ops/op_host/fused_deep_moe.cpp`, takes INT8 FRACTAL_NZ weights and
  fp32 scales only; no source shows a BF16 form); gmm2 weights `[E, H, I]` untransposed;
  bs in [1, 256] (max_tokens), hidden in [512, 7168] and a multiple of 32, gmm1 width 2I in
  [1024, 6144] and a multiple of 1024, top_k <= 12 (and <= experts), experts <= 512;
  fp32 scales; tile-permuted gmm1 weights.
- FuseMode.DISPATCH_FFN_COMBINE (2, `aclnnDispatchFFNCombine`): W8A8 INT8 only, no shared
  experts, scales as int64 bit patterns; the API-level limits (bs, hidden) of the same page.
  Its kernel's own shape limits are not documented, so only these are declared.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.config import Activation
from moehal.ep_dispatcher import check_process_group
from moehal.interfaces import BuildRequest, FusedForward, FusedRunner
from moehal.kernels.host import dense_aligned
from moehal.quant import W8A8_INT8, QuantKind
from moehal.routing import TopK
from moehal_npu.common import BACKEND, NpuImplementation, vendor_ops
from moehal_npu.emulation import DISPATCH_FFN_COMBINE, FUSED_DEEP_MOE
from moehal_npu.weights import DISPATCH_FFN_COMBINE_LAYOUT, FUSED_DEEP_MOE_LAYOUT, NpuWeights

MAX_BS = 256
MIN_HIDDEN, MAX_HIDDEN, HIDDEN_ALIGN = 512, 7168, 32
MIN_GMM1, MAX_GMM1, GMM1_ALIGN = 1024, 6144, 1024
MAX_TOPK = 12
MAX_EXPERTS = 512
DOC = "DeepEP-Ascend FUSED_DEEP_MOE.md"


class FuseEPRunner(FusedRunner):
    def __init__(self, req: BuildRequest, fuse_mode: int) -> None:
        c = req.config
        self.ops = vendor_ops(req)
        self.fuse_mode = fuse_mode
        self.quant_mode = 1 if req.quant.kind is QuantKind.W8A8_INT8 else 0
        self.num_experts, self.scale, self.dtype = c.num_experts, c.routed_scaling_factor, c.dtype
        max_tokens = int(c.max_tokens or 0)
        # FUSED_DEEP_MOE: tokens each rank dispatches; DISPATCH_FFN_COMBINE: the rows a rank may
        # receive (the vendor doc's max_output_size), as sgl-kernel-npu's own test of the mode
        # passes it: tokens * top_k * ranks (`expected_max_dispatch_tokens`)
        recv_bound = max_tokens * c.ep_size * c.top_k
        self.num_max_tokens = max_tokens if fuse_mode == FUSED_DEEP_MOE else recv_bound
        self.buffer = self.ops.low_latency_buffer(
            req.process_group, max_tokens, c.hidden_size, c.num_experts, c.num_local_experts
        )
        self.w: NpuWeights | None = None

    def load(self, weights: Any) -> None:
        if not isinstance(weights, NpuWeights) or weights.w13_scale is None or weights.w2_scale is None:
            raise TypeError("FuseEP takes NpuWeights with scales from its weight processor")
        self.w = weights

    def forward(self, hidden: torch.Tensor, topk: TopK | None, router_logits: torch.Tensor | None) -> torch.Tensor:
        assert self.w is not None, "weights not loaded"
        assert topk is not None, "FuseEP takes routed top-k"
        w = self.w
        # dense operands: fused_deep_moe is a custom op (DeepEP-Ascend) that takes its tensors'
        # memory as laid out, and the caller's may be views (wider rows, column-major top-k)
        out, _ = self.ops.fused_deep_moe(
            self.buffer,
            dense_aligned(hidden),
            topk.ids.to(torch.int64).contiguous(),
            topk.weights.float().contiguous(),
            w.w13,
            w.w13_scale,
            w.w2,
            w.w2_scale,
            self.num_max_tokens,
            self.num_experts,
            self.quant_mode,
            self.fuse_mode,
        )
        if self.scale != 1.0:
            out = out.float() * self.scale
        return out.to(self.dtype)


class _FuseEP(NpuImplementation, FusedForward):
    accepts = frozenset({"topk"})
    activations = frozenset({Activation.SILU})
    supports_non_gated = False
    supports_bias = False
    supports_router_weight_on_input = False
    graph_capturable = True
    # DeepEP-Ascend documents topk_idx -1 as "routed to no expert" (doc/FUSED_DEEP_MOE*.md); the
    # emulation follows it. Not run on an Ascend device here.
    drops_padding_ids = True
    extra_libraries = (("deep_ep", "DeepEP-Ascend, built from sgl-project/sgl-kernel-npu"),)
    fuse_mode: ClassVar[int]
    mode_name: ClassVar[str]

    def check_activation(self, req: BuildRequest) -> Decision:
        d = super().check_activation(req)
        c = req.config
        if d.ok or (c.activation in self.activations and c.gated):  # a bias or weight-on-input decline
            return d
        return decline(f"{d.reason}: fused_deep_moe's epilogue is SwiGLU (SiLU-gated) only", "activation")

    def check_quant(self, req: BuildRequest) -> Decision:
        d = self.check_dtype(req)
        if not d.ok:
            return d
        d = super().check_quant(req)
        if d.ok:
            return d
        modes = "INT8 weights only (its op definition)" if self.fuse_mode == FUSED_DEEP_MOE else "W8A8 INT8 only"
        return decline(f"{d.reason}: {self.mode_name} takes {modes} ({DOC})", d.predicate)

    def check_parallel(self, req: BuildRequest) -> Decision:
        if req.emulating(BACKEND):
            if req.config.ep_size != 1:
                return decline(
                    "the emulated fused_deep_moe models one rank (EP world size 1); multi-rank FuseEP runs "
                    "only on Ascend hardware",
                    "parallel",
                )
            return accept(predicate="parallel")
        if req.process_group is None:
            return decline(
                "fused_deep_moe runs on a DeepEP-Ascend low-latency buffer over the expert-parallel group: "
                "pass MoELayer(process_group=...)",
                "parallel",
            )
        # its buffer is sized from the group and it loads E / ep_size experts: the two must agree
        return check_process_group(req)

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.max_tokens is None or not 1 <= c.max_tokens <= MAX_BS:
            return decline(
                f"{self.mode_name} takes a batch of 1..{MAX_BS} tokens per rank: set MoEConfig.max_tokens "
                f"<= {MAX_BS} (got {c.max_tokens}; {DOC})",
                "shape",
            )
        h = c.hidden_size
        if not MIN_HIDDEN <= h <= MAX_HIDDEN or h % HIDDEN_ALIGN:
            return decline(
                f"{self.mode_name} takes hidden_size in [{MIN_HIDDEN}, {MAX_HIDDEN}] and a multiple of "
                f"{HIDDEN_ALIGN}, got {h} ({DOC})",
                "shape",
            )
        return accept(predicate="shape")

    def build(self, req: BuildRequest) -> FusedRunner:
        return FuseEPRunner(req, self.fuse_mode)


class FusedDeepMoe(_FuseEP):
    """FuseMode.FUSED_DEEP_MOE: the default fuse mode; W8A8 INT8."""

    name = "fuseep_fused_deep_moe"
    mode_name = "FuseMode.FUSED_DEEP_MOE"
    priority = 30
    description = "DeepEP-Ascend fused_deep_moe, FuseMode.FUSED_DEEP_MOE (aclnnFusedDeepMoe), W8A8 INT8"
    quant_schemes = frozenset({W8A8_INT8})
    fuse_mode = FUSED_DEEP_MOE
    weight_layout = FUSED_DEEP_MOE_LAYOUT

    def check_shape(self, req: BuildRequest) -> Decision:
        d = super().check_shape(req)
        if not d.ok:
            return d
        c = req.config
        n = 2 * c.intermediate_size
        if not MIN_GMM1 <= n <= MAX_GMM1 or n % GMM1_ALIGN:
            return decline(
                f"{self.mode_name} takes a gmm1 width 2*intermediate_size in [{MIN_GMM1}, {MAX_GMM1}] and a "
                f"multiple of {GMM1_ALIGN}, got {n} (FusedDeepMoe tiling checks)",
                "shape",
            )
        if c.top_k > MAX_TOPK:
            return decline(f"{self.mode_name} takes top_k <= {MAX_TOPK}, got {c.top_k}", "shape")
        if c.num_experts > MAX_EXPERTS:
            return decline(f"{self.mode_name} takes at most {MAX_EXPERTS} experts, got {c.num_experts}", "shape")
        return accept(predicate="shape")


class DispatchFfnCombine(_FuseEP):
    """FuseMode.DISPATCH_FFN_COMBINE: W8A8 INT8 only, no shared experts."""

    # sgl-kernel-npu's own test of this mode: "Currently, topk=-1 is not supported" (it sends no
    # -1 ids there, while its FUSED_DEEP_MOE test does)
    drops_padding_ids = False
    name = "fuseep_dispatch_ffn_combine"
    mode_name = "FuseMode.DISPATCH_FFN_COMBINE"
    priority = 25
    description = "DeepEP-Ascend fused_deep_moe, FuseMode.DISPATCH_FFN_COMBINE (aclnnDispatchFFNCombine), W8A8 INT8"
    quant_schemes = frozenset({W8A8_INT8})
    fuse_mode = DISPATCH_FFN_COMBINE
    weight_layout = DISPATCH_FFN_COMBINE_LAYOUT

    def check_libraries(self, req: BuildRequest) -> Decision:
        d = super().check_libraries(req)
        if not d.ok or req.emulating(BACKEND):
            return d
        from moehal_npu.ops import fuse_mode_enum

        if fuse_mode_enum() is None:
            return decline(
                "this DeepEP-Ascend predates fuse modes (no deep_ep.buffer.FuseMode); DISPATCH_FFN_COMBINE "
                "needs a newer sgl-kernel-npu build",
                "libraries",
            )
        return d
