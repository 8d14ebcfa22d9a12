"""FlashInfer MoE kernels for SM100 (Blackwell): TensorRT-LLM-gen fused MoE (FP8 block-scale and
FP8 per-tensor, routing inside the kernel from router logits) and CuteDSL NVFP4 experts (masked
path for DeepEP low-latency output, standard path for token-major input).

Written against the documented API (FlashInfer `fused_moe/core.py`, `cute_dsl`; see
docs/backends/cuda.md) and NOT RUN here: the verification machines are SM90, where every class
declines with 'needs SM100 (Blackwell); this device is sm90'. The host-side weight transforms
they use (`flashinfer_layouts`) are tested on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.config import Activation
from moehal.formats import ActivationFormat, Layout, MaskedInput, MaskedOutput, StandardInput, StandardOutput
from moehal.hardware import module_available, package_version
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner, FusedForward, FusedRunner, WeightProcessor
from moehal.kernels.host import dense_aligned
from moehal.quant import FP8_BLOCK, FP8_TENSOR, NVFP4, fp8
from moehal.routing import RoutingMethod, TopK
from moehal.weights import ExpertWeights
from moehal_cuda import flashinfer_layouts as L
from moehal_cuda.support import (
    FLASHINFER_BF16_LOGITS,
    FLASHINFER_MIN,
    FLASHINFER_SOFTMAX_ROUTING,
    at_least,
    older_than,
    sm_decision,
)

SM100 = (100, 103)
# trtllm-gen RoutingMethodType (flashinfer tllm_enums.py)
ROUTING_DEFAULT, ROUTING_RENORMALIZE, ROUTING_DEEPSEEK_V3 = 0, 1, 2


def flashinfer_version() -> str | None:
    return package_version("flashinfer-python") or package_version("flashinfer")


def flashinfer_decision(needed: Sequence[str]) -> Decision:
    if not module_available("flashinfer"):
        return decline("flashinfer is not installed (pip install flashinfer-python)", "libraries")
    v = flashinfer_version()
    if v is not None and not at_least(v, FLASHINFER_MIN):
        return decline(f"flashinfer {v} {older_than(v, FLASHINFER_MIN)}", "libraries")
    try:
        import flashinfer
        import flashinfer.fused_moe as fmoe
    except Exception as exc:  # noqa: BLE001
        return decline(f"flashinfer failed to import: {type(exc).__name__}: {exc}", "libraries")
    del flashinfer, fmoe  # imported to report a broken install above; names resolve through `_fi`
    missing = [n for n in needed if _fi_lookup(n) is None]
    if missing:
        return decline(f"flashinfer {v} lacks {missing} (looked in {', '.join(FI_MODULES)})", "libraries")
    return accept(f"flashinfer {v}", "libraries")


# Where FlashInfer keeps the names used here, across releases: the fused MoE API in `fused_moe`
# (re-exported at the top level), the CuteDSL masked grouped GEMM in `cute_dsl.blockscaled_gemm`
# (re-exported by `gemm` in later releases; neither re-exports it at the top level), the NVFP4
# grouped quantizers in `cute_dsl` and `fp4_quantization`.
FI_MODULES = (
    "flashinfer.fused_moe",
    "flashinfer",
    "flashinfer.gemm",
    "flashinfer.cute_dsl",
    "flashinfer.cute_dsl.blockscaled_gemm",
    "flashinfer.fp4_quantization",
)


def _fi_lookup(name: str) -> Any | None:
    """FlashInfer's `name` from the first of `FI_MODULES` that has it, or None."""
    import importlib

    for mod in FI_MODULES:
        try:
            found = getattr(importlib.import_module(mod), name, None)
        except Exception:  # noqa: BLE001 - a module this release lacks, or one that fails to import
            continue
        if found is not None:
            return found
    return None


@functools.cache
def _fi(name: str) -> Any:
    """FlashInfer's `name` (resolved once; `flashinfer_decision` checked that it exists)."""
    found = _fi_lookup(name)
    if found is None:
        raise ImportError(f"flashinfer has no {name} in {FI_MODULES}")
    return found


def routing_method_type(req: BuildRequest) -> int:
    r = req.config.routing
    assert r is not None
    if r.method is RoutingMethod.DEEPSEEK_V3:
        return ROUTING_DEEPSEEK_V3
    return ROUTING_RENORMALIZE if r.renormalize else ROUTING_DEFAULT


def kernel_route_scale(req: BuildRequest) -> float:
    """The `routed_scaling_factor` to hand the trtllm-gen kernel. Only its DeepSeek-V3 routing
    applies the argument (it scales the top-k weights: `mRouteScale`). Its softmax routings
    (`routingCustom`) ignore it, so there it is folded into GEMM2's output scales at load
    (`w2_scale_factor`), and the kernel gets 1.0, in case a later release starts applying it."""
    factor = float(req.config.routed_scaling_factor)
    return factor if routing_method_type(req) == ROUTING_DEEPSEEK_V3 else 1.0


def w2_scale_factor(req: BuildRequest) -> float:
    """What GEMM2's output scales are multiplied by at load: the routed scaling the kernel's
    routing does not apply (`kernel_route_scale`); the output is linear in them."""
    return 1.0 if routing_method_type(req) == ROUTING_DEEPSEEK_V3 else float(req.config.routed_scaling_factor)


def bf16_logits_ok() -> bool:
    """Whether the installed trtllm-gen launcher takes bf16 logits for DeepSeek-V3 routing
    (a package-metadata read: ask once per layer, not per forward)."""
    return at_least(flashinfer_version(), FLASHINFER_BF16_LOGITS)


def logits_for_kernel(logits: torch.Tensor, method: int, bf16_ok: bool) -> torch.Tensor:
    """The routing logits as the installed trtllm-gen launcher takes them: fp32 always, bf16 as
    given where the release takes it. DeepSeek-V3 routing takes bf16 from flashinfer 0.6.8
    (`bf16_ok`). The softmax routings take fp32 or bf16 in every release moehal runs them on
    (0.6.8+, `FLASHINFER_SOFTMAX_ROUTING`; fp32 came with flashinfer PR #2534 for issue
    #2469), so fp32 logits stay fp32 there: rounding them to bf16 could pick other experts
    than the layer's fp32 router did. Other dtypes (fp16) go as fp32, which holds them exactly.
    Always contiguous: the launcher checks only their dtype and shape, and its routing kernel
    reads `[token * E + e]` from the data pointer."""
    keep_bf16 = logits.dtype == torch.bfloat16 and (bf16_ok or method != ROUTING_DEEPSEEK_V3)
    return logits.to(torch.bfloat16 if keep_bf16 else torch.float32).contiguous()


# The launcher's bound for its softmax routings (Renormalize and RenormalizeNaive: `top_k <= 10 &&
# top_k > 0` in `check_routing` of flashinfer's csrc/trtllm_fused_moe_kernel_launcher.cu, 0.6 releases)
SOFTMAX_MAX_TOP_K = 10


def routing_limits(req: BuildRequest) -> Decision:
    """The trtllm-gen routing kernel's limits, which its launcher asserts at the first forward
    (`check_routing` of flashinfer's `csrc/trtllm_fused_moe_kernel_launcher.cu`): checked at
    build so that another pipeline is chosen instead."""
    c, r = req.config, req.config.routing
    assert r is not None
    if c.num_experts % 4:
        return decline(f"the trtllm-gen routing kernel needs num_experts % 4 == 0, got {c.num_experts}", "routing")
    if c.num_experts <= c.top_k:
        why = f"the trtllm-gen routing kernel needs num_experts > top_k ({c.num_experts} <= {c.top_k})"
        return decline(why, "routing")
    if r.method is RoutingMethod.SOFTMAX and c.top_k > SOFTMAX_MAX_TOP_K:
        return decline(
            f"the trtllm-gen softmax routing supports top_k <= {SOFTMAX_MAX_TOP_K} (got {c.top_k}); its "
            "launcher asserts it at the first forward",
            "routing",
        )
    if r.method is RoutingMethod.DEEPSEEK_V3:
        reachable = r.topk_group * c.num_experts // r.n_group
        if c.top_k > 8 or r.topk_group > 4:
            return decline(
                f"the trtllm-gen grouped routing supports top_k <= 8 and topk_group <= 4 "
                f"(got {c.top_k} and {r.topk_group})",
                "routing",
            )
        if c.top_k >= reachable:
            return decline(
                f"the trtllm-gen grouped routing needs top_k < topk_group * num_experts / n_group "
                f"({c.top_k} >= {reachable})",
                "routing",
            )
    return accept(predicate="routing")


# --- TensorRT-LLM-gen fused MoE ---------------------------------------------------------------------


@dataclass
class TrtllmWeights:
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None  # fp8 block: [E, 2I/128, H/128] in w3/w1 order
    w2_scale: torch.Tensor | None
    out1_scale: torch.Tensor | None = None  # fp8 per-tensor: [E] scalars
    out1_gate_scale: torch.Tensor | None = None
    out2_scale: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None


def prepare_trtllm_fp8_block(weights: ExpertWeights, w2_scaling: float = 1.0) -> TrtllmWeights:
    """Canonical FP8 block weights -> trtllm-gen MajorK layout: W13 (and its scale blocks) in
    w3-then-w1 order (the kernel's GEMM1 is (up, gate)); W2 unchanged, its block scales times
    `w2_scaling` (`w2_scale_factor`)."""
    assert weights.w13_scale is not None and weights.w2_scale is not None
    return TrtllmWeights(
        L.swap_w13_halves(weights.w13),
        weights.w2.contiguous(),
        L.swap_w13_halves(weights.w13_scale.float()),
        (weights.w2_scale.float() * w2_scaling).contiguous(),
        correction_bias=weights.correction_bias,
    )


def prepare_trtllm_fp8_tensor(
    weights: ExpertWeights, epilogue_tile_m: int = 128, w2_scaling: float = 1.0
) -> TrtllmWeights:
    """Canonical FP8 per-tensor weights -> trtllm-gen: W13 swapped to [w3; w1], rows interleaved
    for the gated activation, both weights row-shuffled for the epilogue tile; the three
    per-expert output scales folded from weight and static activation scales (GEMM2's times
    `w2_scaling`, `w2_scale_factor`)."""
    assert weights.w13_scale is not None and weights.w2_scale is not None
    assert weights.a13_scale is not None and weights.a2_scale is not None
    w13 = L.swap_w13_halves(weights.w13).view(torch.uint8)
    w13 = L.shuffle_rows_for_epilogue(L.reorder_rows_for_gated_act(w13), epilogue_tile_m).view(fp8.FP8_DTYPE)
    w2 = L.shuffle_rows_for_epilogue(weights.w2.view(torch.uint8), epilogue_tile_m).view(fp8.FP8_DTYPE)
    a13, a2 = weights.a13_scale.float(), weights.a2_scale.float()
    s13, s2 = weights.w13_scale.float(), weights.w2_scale.float()
    return TrtllmWeights(
        w13,
        w2,
        None,
        None,
        out1_scale=(a13 * s13 / a2).contiguous(),  # GEMM1 output requantized with a2
        out1_gate_scale=(a13 * s13).contiguous(),
        out2_scale=(a2 * s2 * w2_scaling).contiguous(),
        a13_scale=a13,
        correction_bias=weights.correction_bias,
    )


class _TrtllmProcessor(WeightProcessor):
    devices = frozenset({"cuda"})
    priority = 10

    def check_hardware(self, req: BuildRequest) -> Decision:
        return sm_decision(req, SM100, "TensorRT-LLM-gen MoE")


class TrtllmFp8BlockProcessor(_TrtllmProcessor):
    name = "trtllm_fp8_block_weights"
    layout = "trtllm_fp8_block"
    description = (
        "canonical fp8 block-scale -> TensorRT-LLM-gen MajorK: W13 as [w3; w1], routed scaling folded into W2's scales"
    )
    quant_schemes = frozenset({FP8_BLOCK})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        return prepare_trtllm_fp8_block(weights, w2_scale_factor(req))


class TrtllmFp8TensorProcessor(_TrtllmProcessor):
    name = "trtllm_fp8_tensor_weights"
    layout = "trtllm_fp8_tensor"
    description = (
        "canonical fp8 per-tensor -> TensorRT-LLM-gen: W13 as [w3; w1], gated rows interleaved, rows shuffled "
        "for the epilogue; output scales folded"
    )
    quant_schemes = frozenset({FP8_TENSOR})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        return prepare_trtllm_fp8_tensor(weights, w2_scaling=w2_scale_factor(req))


class _TrtllmRunner(FusedRunner):
    def __init__(self, req: BuildRequest) -> None:
        self.req, self.c = req, req.config
        self.method = routing_method_type(req)
        self.w: TrtllmWeights | None = None
        r = req.config.routing
        assert r is not None
        # 0 without groups: releases before Optional[int] typed these int (vLLM passes 0 too)
        self.n_group = r.n_group if r.method is RoutingMethod.DEEPSEEK_V3 else 0
        self.topk_group = r.topk_group if r.method is RoutingMethod.DEEPSEEK_V3 else 0
        self.route_scale = kernel_route_scale(req)
        self.bf16_logits = bf16_logits_ok()

    def load(self, weights: Any) -> None:
        self.w = weights

    def _bias(self) -> torch.Tensor | None:
        assert self.w is not None
        cb = self.w.correction_bias
        # bf16, as SGLang and vLLM pass it and as launchers before the routing refactor require.
        # Recent launchers also take fp32 (mRoutingBiasDtype); the rounding can flip a near tie
        # against moehal's fp32 routing, which conformance's tolerances have not met so far
        # (not run: SM100).
        return cb.to(torch.bfloat16) if cb is not None else None

    def _out(self, y: Any) -> torch.Tensor:
        """The kernel's result in the layer dtype: a tensor with `do_finalize=True`, which
        FlashInfer plans to return as a one-element list from 0.8."""
        if isinstance(y, (list, tuple)):
            y = y[0]
        return y.to(self.c.dtype)


class TrtllmFp8BlockRunner(_TrtllmRunner):
    def forward(self, hidden: torch.Tensor, topk: TopK | None, router_logits: torch.Tensor | None) -> torch.Tensor:
        assert router_logits is not None and self.w is not None
        c, w = self.c, self.w
        q, s = fp8.quantize_group(hidden)  # 1x128 groups; the kernel wants scales [H/128, T]
        y = _fi("trtllm_fp8_block_scale_moe")(
            logits_for_kernel(router_logits, self.method, self.bf16_logits),
            self._bias(),
            q,
            s.t().contiguous(),
            w.w13,
            w.w13_scale,
            w.w2,
            w.w2_scale,
            c.num_experts,
            c.top_k,
            self.n_group,
            self.topk_group,
            c.intermediate_size,
            c.local_expert_start,
            c.num_local_experts,
            self.route_scale,
            routing_method_type=self.method,
            use_shuffled_weight=False,
            weight_layout=0,
        )
        return self._out(y)


class TrtllmFp8TensorRunner(_TrtllmRunner):
    def forward(self, hidden: torch.Tensor, topk: TopK | None, router_logits: torch.Tensor | None) -> torch.Tensor:
        assert router_logits is not None and self.w is not None and self.w.a13_scale is not None
        c, w = self.c, self.w
        q, _ = fp8.quantize_tensor(hidden, self.w.a13_scale)
        y = _fi("trtllm_fp8_per_tensor_scale_moe")(
            logits_for_kernel(router_logits, self.method, self.bf16_logits),
            self._bias(),
            q,
            w.w13,
            w.out1_scale,
            w.out1_gate_scale,
            w.w2,
            w.out2_scale,
            c.num_experts,
            c.top_k,
            self.n_group,
            self.topk_group,
            c.intermediate_size,
            c.local_expert_start,
            c.num_local_experts,
            self.route_scale,
            False,  # use_routing_scales_on_input
            routing_method_type=self.method,
        )
        return self._out(y)


class _TrtllmFused(FusedForward):
    devices = frozenset({"cuda"})
    priority = 30
    accepts = frozenset({"logits"})
    routing_methods = frozenset({RoutingMethod.SOFTMAX, RoutingMethod.DEEPSEEK_V3})
    activations = frozenset({Activation.SILU})
    supports_non_gated = False
    supports_bias = False
    supports_router_weight_on_input = False
    graph_capturable = True
    _fn: ClassVar[str]

    def check_hardware(self, req: BuildRequest) -> Decision:
        return sm_decision(req, SM100, "TensorRT-LLM-gen MoE")

    def check_libraries(self, req: BuildRequest) -> Decision:
        return flashinfer_decision([self._fn])

    def check_routing(self, req: BuildRequest) -> Decision:
        d = super().check_routing(req)
        r = req.config.routing
        if not d.ok or r is None:
            return d
        if r.method is RoutingMethod.DEEPSEEK_V3 and not r.renormalize:
            return decline(
                "the kernel's DeepSeek-V3 routing always divides the selected weights by their sum "
                "(norm_topk_prob); RoutingConfig.renormalize=False asks for raw weights",
                "routing",
            )
        if r.method is RoutingMethod.SOFTMAX:
            v = flashinfer_version()
            if not at_least(v, FLASHINFER_SOFTMAX_ROUTING):
                want = ".".join(map(str, FLASHINFER_SOFTMAX_ROUTING))
                return decline(
                    f"trtllm-gen softmax routing needs flashinfer >= {want} (found {v}): older releases "
                    "raise on softmax without renormalization and pick wrong experts when every logit "
                    "is negative (flashinfer issue #2822)",
                    "routing",
                )
        return routing_limits(req)

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.dtype != torch.bfloat16:
            return decline(f"trtllm-gen MoE returns bf16; the layer dtype is {c.dtype}", "shape")
        if c.hidden_size % 128 or c.intermediate_size % 128:
            return decline("hidden_size and intermediate_size must be multiples of 128", "shape")
        return accept(predicate="shape")


class TrtllmFp8BlockMoE(_TrtllmFused):
    """FlashInfer `trtllm_fp8_block_scale_moe`: routing + FP8 1x128/128x128 GEMMs in one kernel."""

    name = "trtllm_fp8_block"
    description = "FlashInfer TensorRT-LLM-gen fused MoE, FP8 block scale, routing in the kernel (SM100)"
    quant_schemes = frozenset({FP8_BLOCK})
    weight_layout: ClassVar[str] = "trtllm_fp8_block"
    _fn = "trtllm_fp8_block_scale_moe"

    def build(self, req: BuildRequest) -> FusedRunner:
        return TrtllmFp8BlockRunner(req)


class TrtllmFp8TensorMoE(_TrtllmFused):
    """FlashInfer `trtllm_fp8_per_tensor_scale_moe` (static per-tensor activation scales)."""

    name = "trtllm_fp8_tensor"
    description = "FlashInfer TensorRT-LLM-gen fused MoE, FP8 per-tensor, routing in the kernel (SM100)"
    quant_schemes = frozenset({FP8_TENSOR})
    weight_layout: ClassVar[str] = "trtllm_fp8_tensor"
    _fn = "trtllm_fp8_per_tensor_scale_moe"

    def build(self, req: BuildRequest) -> FusedRunner:
        return TrtllmFp8TensorRunner(req)


# --- CuteDSL NVFP4 experts --------------------------------------------------------------------


@dataclass
class CuteDslWeights:
    w13: torch.Tensor  # uint8 packed FP4
    w13_sf: torch.Tensor  # e4m3 block scales, kernel layout
    w2: torch.Tensor
    w2_sf: torch.Tensor
    w13_alpha: torch.Tensor  # fp32 [E]: 1 / (a13_gs * w13_gs)
    w2_alpha: torch.Tensor
    a13_gs: torch.Tensor  # fp32 [] (or [E] broadcast for the masked quantizer)
    a2_gs: torch.Tensor


def prepare_cutedsl_nvfp4(weights: ExpertWeights, standard: bool) -> CuteDslWeights:
    """Canonical NVFP4 -> CuteDSL. Standard path: W13 and its scales as [up; gate] interleaved
    in 64-row chunks, block scales 128x4-swizzled. Masked path: [gate; up] kept, block scales
    128x4-swizzled (the MMA layout the masked grouped GEMM reads)."""
    assert weights.w13_scale is not None and weights.w2_scale is not None
    assert weights.w13_global_scale is not None and weights.w2_global_scale is not None
    assert weights.a13_scale is not None and weights.a2_scale is not None
    w13, s13 = weights.w13, weights.w13_scale
    if standard:
        w13 = L.interleave_w13_halves(L.swap_w13_halves(w13))
        s13 = L.interleave_w13_halves(L.swap_w13_halves(s13))
    sf13 = L.swizzle_block_scales_128x4(s13.view(torch.uint8)).view(torch.float8_e4m3fn)
    sf2 = L.swizzle_block_scales_128x4(weights.w2_scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    a13, a2 = weights.a13_scale.float(), weights.a2_scale.float()
    return CuteDslWeights(
        w13.contiguous(),
        sf13,
        weights.w2.contiguous(),
        sf2,
        (1.0 / (a13 * weights.w13_global_scale.float())).contiguous(),
        (1.0 / (a2 * weights.w2_global_scale.float())).contiguous(),
        a13,
        a2,
    )


class _CuteDslProcessor(WeightProcessor):
    devices = frozenset({"cuda"})
    priority = 10
    quant_schemes = frozenset({NVFP4})
    standard: ClassVar[bool]

    def check_hardware(self, req: BuildRequest) -> Decision:
        return sm_decision(req, SM100, "FlashInfer CuteDSL NVFP4")

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        return prepare_cutedsl_nvfp4(weights, self.standard)


class CuteDslStandardProcessor(_CuteDslProcessor):
    name = "cutedsl_nvfp4_weights"
    layout = "cutedsl_nvfp4"
    description = "canonical NVFP4 -> CuteDSL standard path: W13 [up; gate] in 64-row chunks, 128x4-swizzled scales"
    standard = True


class CuteDslMaskedProcessor(_CuteDslProcessor):
    name = "cutedsl_nvfp4_masked_weights"
    layout = "cutedsl_nvfp4_masked"
    description = "canonical NVFP4 -> CuteDSL masked path: W13 [gate; up], 128x4-swizzled block scales"
    standard = False


class CuteDslStandardRunner(ExpertsRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        c = req.config
        self.fmt, self.c = fmt, c
        self.w: CuteDslWeights | None = None
        self.wrapper = _fi("CuteDslMoEWrapper")(
            num_experts=c.num_experts,
            top_k=c.top_k,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            use_cuda_graph=True,
            num_local_experts=c.num_local_experts,
            local_expert_offset=c.local_expert_start,
            output_dtype=c.dtype,
            # releases that preallocate for CUDA graphs size their buffers by it (later ones
            # accept and ignore it)
            **({"max_num_tokens": c.max_tokens} if c.max_tokens is not None else {}),
        )  # (built with the layer's GPU current, where the wrapper's "cuda" default allocates)
        # Releases that preallocate (flashinfer 0.6's wrapper, `_moe_output`) return a view of
        # the wrapper's own output buffer, which the next call overwrites, and raise past
        # `max_num_tokens` (4096 when not given); later releases allocate per call.
        self._own_output: torch.Tensor | None = getattr(self.wrapper, "_moe_output", None)
        self._max_rows = int(getattr(self.wrapper, "max_num_tokens", 0) or 0) if self._own_output is not None else 0

    def load(self, weights: Any) -> None:
        self.w = weights

    def apply(self, inp: Any) -> Any:
        assert isinstance(inp, StandardInput) and self.w is not None
        w, c = self.w, self.c
        # the wrapper gathers token rows: their block scales in the linear [T, H/16] layout (only
        # the weights' scales are swizzled), as FlashInfer's own MoE tests and SGLang quantize.
        # fp4_quantize checks that its input is contiguous (CHECK_CONTIGUOUS in its fp4Quantize.cpp);
        # token-major input is the caller's tensor, which may be a view of wider rows.
        h = dense_aligned(inp.hidden)  # (no copy when it is; aligned for its vector loads)
        x, x_sf = _fi("fp4_quantize")(h, w.a13_gs.reshape(1), sf_vec_size=16, is_sf_swizzled_layout=False)
        # local ids (-1 = remote) -> global ids. The wrapper's routing (`moe_sort`) skips ids
        # outside this rank's experts, so remote slots get the first expert past them: no GEMM
        # rows. With every expert local (-1 then marks padding) that is a local expert, weight 0.
        ids = inp.topk_ids
        valid = ids >= 0
        remote = (c.local_expert_start + c.num_local_experts) % c.num_experts
        gids = torch.where(valid, ids + c.local_expert_start, torch.full_like(ids, remote))
        wts = torch.where(valid, inp.topk_weights, torch.zeros_like(inp.topk_weights))
        weights = (w.w13, w.w13_sf, w.w13_alpha, w.a2_gs.reshape(1), w.w2, w.w2_sf, w.w2_alpha)
        if self._own_output is None:  # a fresh tensor per call
            return StandardOutput(self.wrapper.run(x, x_sf, gids, wts, *weights))
        # a view of the wrapper's buffer: copied out, in pieces of at most the rows it holds
        t, step = x.shape[0], self._max_rows or x.shape[0]
        y = torch.empty(t, c.hidden_size, dtype=c.dtype, device=x.device)
        for s in range(0, t, max(step, 1)):
            e = s + step
            y[s:e].copy_(self.wrapper.run(x[s:e], x_sf[s:e], gids[s:e], wts[s:e], *weights))
        return StandardOutput(y)


class CuteDslMaskedRunner(ExpertsRunner):
    """DeepEP low-latency layout: quantize [E, M, H] per expert to NVFP4, masked grouped GEMM,
    fused SiLU-and-mul + NVFP4 requant, masked grouped GEMM."""

    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        self.fmt, self.c = fmt, req.config
        self.w: CuteDslWeights | None = None

    def load(self, weights: Any) -> None:
        self.w = weights

    def apply(self, inp: Any) -> Any:
        assert isinstance(inp, MaskedInput) and self.w is not None
        w, c = self.w, self.c
        e, m, h = inp.hidden.shape
        i = c.intermediate_size
        gemm = _fi("grouped_gemm_nt_masked")
        kw = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=16)
        a13 = w.a13_gs.reshape(1).expand(e).contiguous()
        a2 = w.a2_gs.reshape(1).expand(e).contiguous()
        xq, xs = _fi("scaled_fp4_grouped_quantize")(inp.hidden, inp.masked_m, a13)
        # outputs are logical (m, n, l) over (l, m, n) memory: the kernel writes through its
        # data pointer with N innermost, experts outermost
        h1 = torch.empty(e, m, 2 * i, dtype=torch.bfloat16, device=inp.hidden.device).permute(1, 2, 0)
        w13 = w.w13.permute(1, 2, 0)  # [2I, H/2, E] logical (n, k, l)
        gemm((xq, xs), (w13, w.w13_sf), h1, inp.masked_m, alpha=w.w13_alpha.view(1, 1, e), alpha_dtype="float32", **kw)
        aq, as_ = _fi("silu_and_mul_scaled_nvfp4_experts_quantize")(h1.permute(2, 0, 1), inp.masked_m, a2)
        y = torch.empty(e, m, h, dtype=torch.bfloat16, device=inp.hidden.device).permute(1, 2, 0)
        w2 = w.w2.permute(1, 2, 0)
        gemm((aq, as_), (w2, w.w2_sf), y, inp.masked_m, alpha=w.w2_alpha.view(1, 1, e), alpha_dtype="float32", **kw)
        out = y.permute(2, 0, 1)
        live = torch.arange(m, device=out.device)[None, :] < inp.masked_m[:, None]
        return MaskedOutput(torch.where(live[..., None], out, 0).to(c.dtype))


class CuteDslNvfp4Experts(Experts):
    """FlashInfer CuteDSL NVFP4 experts; one registration per dispatch format it consumes, so a
    masked dispatcher (DeepEP low latency) always finds the masked variant."""

    devices = frozenset({"cuda"})
    priority = 30
    quant_schemes = frozenset({NVFP4})
    activations = frozenset({Activation.SILU})
    supports_non_gated = False
    supports_bias = False
    graph_capturable = True
    layout_kind: ClassVar[Layout]

    @staticmethod
    def variants() -> list[Experts]:
        return [CuteDslNvfp4StandardExperts(), CuteDslNvfp4MaskedExperts()]

    def check_hardware(self, req: BuildRequest) -> Decision:
        return sm_decision(req, SM100, "FlashInfer CuteDSL NVFP4")

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.dtype != torch.bfloat16:
            return decline(f"CuteDSL NVFP4 experts return bf16; the layer dtype is {c.dtype}", "shape")
        if c.hidden_size % 128 or c.intermediate_size % 128:
            return decline("hidden_size and intermediate_size must be multiples of 128 (swizzled scales)", "shape")
        return accept(predicate="shape")

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        return [ActivationFormat(self.layout_kind, req.config.dtype)]


class CuteDslNvfp4StandardExperts(CuteDslNvfp4Experts):
    name = "cutedsl_nvfp4"
    description = "FlashInfer CuteDslMoEWrapper (NVFP4 W4A4), token-major input (SM100)"
    weight_layout: ClassVar[str] = "cutedsl_nvfp4"
    layout_kind = Layout.STANDARD
    # The wrapper sums top-k rows with FlashInfer's atomic fused finalize (its default, kept for
    # speed: the two-stage finalize cost vLLM about 3.6%), so equal inputs may differ in the last
    # bits from call to call, as AITER's do. The masked variant has no atomic sum.
    deterministic = False

    def check_libraries(self, req: BuildRequest) -> Decision:
        return flashinfer_decision(["CuteDslMoEWrapper", "fp4_quantize"])

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return CuteDslStandardRunner(req, fmt)


class CuteDslNvfp4MaskedExperts(CuteDslNvfp4Experts):
    name = "cutedsl_nvfp4_masked"
    description = "FlashInfer CuteDSL masked grouped GEMMs (NVFP4), DeepEP low-latency layout (SM100)"
    weight_layout: ClassVar[str] = "cutedsl_nvfp4_masked"
    layout_kind = Layout.MASKED

    def check_libraries(self, req: BuildRequest) -> Decision:
        return flashinfer_decision(
            ["grouped_gemm_nt_masked", "scaled_fp4_grouped_quantize", "silu_and_mul_scaled_nvfp4_experts_quantize"]
        )

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return CuteDslMaskedRunner(req, fmt)


def flashinfer_weight_processors() -> list[WeightProcessor]:
    return [TrtllmFp8BlockProcessor(), TrtllmFp8TensorProcessor(), CuteDslStandardProcessor(), CuteDslMaskedProcessor()]


__all__ = [
    "CuteDslNvfp4Experts",
    "TrtllmFp8BlockMoE",
    "TrtllmFp8TensorMoE",
    "flashinfer_weight_processors",
]
