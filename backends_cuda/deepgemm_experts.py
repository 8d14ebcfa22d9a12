"""DeepGEMM grouped-GEMM experts (SM90 / SM100): BF16 and FP8 block-scale, masked and
contiguous layouts, with the Triton glue of `moehal_cuda.triton_glue` between the GEMMs.

    GEMM1  h = x @ w13^T            m_grouped_{bf16,fp8_fp4}_gemm_nt_{masked,contiguous}, or for
                                    masked input the Triton masked GEMM where this device's
                                    tuned table measured it faster (`moehal_cuda.gemm_choice`)
    glue   a = act(h + b13) -> (FP8 1x128 quant)      one Triton pass, zeroes stale rows
    GEMM2  y = a @ w2^T             same GEMM family
    glue   y += b2 (live rows only, when the layer has w2 biases)

Nothing reads device memory back to the host; buffers are persistent per shape (see
`moehal.kernels.triton_permute.workspace`), so forward is CUDA-graph capturable once the
DeepGEMM JIT kernels are compiled (run one forward before capturing).

Scale layouts: activation scales are produced MN-major and TMA-aligned by our kernels, the
layout DeepGEMM's SM90 kernels consume without a transform. SM90 takes FP32 128x128 weight
scales as they are. SM100 takes UE8M0 scales packed into int32: the weight processor prepares
the weights' once, and DeepGEMM packs the FP32 activation scales at every call (not run: no
SM100 machine; producing them packed, as SGLang's Blackwell path does, would skip that).

FP8 per-tensor (`fp8_tensor`, SM90) is a special case of the block scales: the weight processor
writes each expert's scale into all of its 128x128 blocks, and the dispatcher and the
activation quantize with the checkpoint's static input scales (`ScaleKind.STATIC_TENSOR`),
writing that scale into every 1x128 group's slot. The GEMMs then compute exactly the scheme's
math, (x_q . w_q) * a_scale * w_scale, with no kernel of their own.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.config import MoEConfig
from moehal.errors import WeightError
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    ScaleKind,
    SmallBatchFormat,
    StandardInput,
    StandardOutput,
)
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner, TunedShape, WeightProcessor
from moehal.kernels.host import RecentBinds
from moehal.quant import BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_TENSOR, QuantKind, QuantScheme, ScaleFormat
from moehal.weights import ExpertWeights
from moehal_cuda.gemm_choice import DEEPGEMM, GemmChoice, GemmChooser, entry_key, layer_key
from moehal_cuda.support import (
    claim_deep_gemm_device,
    deep_gemm_decision,
    deep_gemm_device_decision,
    dg_fn,
    import_deep_gemm,
    sm_decision,
    triton_decision,
)

LAYOUT = "deepgemm"
SUPPORTED_SM = (90, 100, 103)
_BF16_FNS = ("m_grouped_bf16_gemm_nt_masked", "m_grouped_bf16_gemm_nt_contiguous")
_FP8_FNS = (
    "m_grouped_fp8_fp4_gemm_nt_masked|m_grouped_fp8_gemm_nt_masked|fp8_m_grouped_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nt_contiguous|m_grouped_fp8_gemm_nt_contiguous",
)
_LAYOUT_FNS = ("get_mk_alignment_for_contiguous_layout|get_m_alignment_for_contiguous_layout",)
_FP8_KINDS = (QuantKind.FP8_BLOCK, QuantKind.FP8_TENSOR)


def _is_sm100(req: BuildRequest) -> bool:
    return (req.hardware.sm or 0) >= 100


@dataclass
class DeepGemmWeights:
    """Weights in DeepGEMM's layout: K-major `[E, N, K]`; FP8 scales FP32 `[E, N/128, K/128]`
    (SM90) or packed UE8M0 int32 (SM100); biases fp32 `[E, N]`; fp8_tensor: the static input
    scales fp32 `[1]` (the dispatcher quantizes with GEMM1's; the portable fused MoE, which
    takes decode batches, reads both), the per-expert scales being any block of the block
    scales."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None


def prepare_weights(weights: ExpertWeights, quant: QuantScheme, sm100: bool, dg: Any | None) -> DeepGemmWeights:
    """Canonical -> DeepGEMM layout (pure torch for SM90; SM100 packs scales with deep_gemm)."""
    b13 = weights.w13_bias.float().contiguous() if weights.w13_bias is not None else None
    b2 = weights.w2_bias.float().contiguous() if weights.w2_bias is not None else None
    w13, w2 = weights.w13.contiguous(), weights.w2.contiguous()
    if quant.kind is QuantKind.BF16:
        return DeepGemmWeights(w13, w2, None, None, b13, b2)
    assert weights.w13_scale is not None and weights.w2_scale is not None
    if quant.kind is QuantKind.FP8_TENSOR:
        assert weights.a2_scale is not None and not sm100
        assert weights.a13_scale is not None
        s13 = per_expert_block_scales(weights.w13_scale, w13.shape)
        s2 = per_expert_block_scales(weights.w2_scale, w2.shape)
        a13, a2 = (a.float().reshape(1).contiguous() for a in (weights.a13_scale, weights.a2_scale))
        return DeepGemmWeights(w13, w2, s13, s2, b13, b2, a13, a2)
    s13, s2 = weights.w13_scale.float().contiguous(), weights.w2_scale.float().contiguous()
    if sm100:
        assert dg is not None
        for name, scale in (("w13_scale", s13), ("w2_scale", s2)):
            check_power_of_two_scales(scale, name)
        e, n13, h = w13.shape
        i = w2.shape[2]
        tf = dg_fn(dg, "transform_sf_into_required_layout")
        s13 = tf(s13, n13, h, (1, 128, 128), num_groups=e, is_sfa=False)
        s2 = tf(s2, h, i, (1, 128, 128), num_groups=e, is_sfa=False)
    return DeepGemmWeights(w13, w2, s13, s2, b13, b2)


def check_power_of_two_scales(scale: torch.Tensor, name: str) -> None:
    """SM100's weight-scale transform packs fp32 scales into UE8M0 exponents, and it asserts on
    the device that each is a power of two: a scale that is not kills the CUDA context at load
    (DeepGEMM `transpose_and_pack_fp32_into_ue8m0`). Checked here on its bits instead, with
    what to do about it."""
    bits = scale.float().contiguous().view(torch.int32)
    # sign or mantissa bits set, or the exponent of Inf/NaN (it packs as UE8M0 0xFF, which is NaN);
    # zero passes: no sign or mantissa bits (it packs as 2^-127)
    bad = int((((bits & 0x807FFFFF) != 0) | ((bits >> 23) & 0xFF == 0xFF)).sum())
    if bad:
        raise WeightError(
            f"{name}: {bad} of {scale.numel()} fp8_block:ue8m0 weight scales are not finite positive powers of two, "
            "which DeepGEMM's SM100 scale packing requires; requantize the checkpoint's weights with UE8M0 "
            "scales (moehal.quantize_weights with the fp8_block:ue8m0 scheme does)"
        )


def per_expert_block_scales(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """fp32 `[E]` per-expert scales -> `[E, N/128, K/128]` block scales of a `[E, N, K]` weight
    (each expert's scale in all of its blocks; `/128` rounds up), as DeepGEMM reads them."""
    e, n, k = shape
    blocks = (e, -(-n // 128), -(-k // 128))
    return scale.float().reshape(e, 1, 1).expand(blocks).contiguous()


class DeepGemmWeightProcessor(WeightProcessor):
    """Canonical weights -> `DeepGemmWeights` (contiguous K-major; SM100: UE8M0-packed scales)."""

    name = "deepgemm_weights"
    layout = LAYOUT
    description = "canonical -> DeepGEMM K-major weights and fp32 block scales (packed UE8M0 once on SM100)"
    priority = 10
    devices = frozenset({"cuda"})
    quant_schemes = frozenset({BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_TENSOR})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        sm100 = _is_sm100(req)
        return prepare_weights(weights, req.quant, sm100, import_deep_gemm() if sm100 else None)


# --- GEMM back-ends -----------------------------------------------------------------------------


class DeepGemmOps:
    """The four DeepGEMM calls, resolved once by name (names differ across releases).

    With `moehal.graphs.MEMO_ENABLED` (on by default; 8-12% less host time per eager forward
    that calls DeepGEMM, see there), eager calls that repeat on the same tensors (a
    decode loop: the dispatcher's and these experts' buffers are persistent workspaces) replay
    a one-kernel CUDA graph instead of DeepGEMM's C++ host path (`moehal.graphs.LaunchMemo`).
    DeepGEMM reads the masked row counts and the contiguous row-to-expert map on the GPU, so a
    graph is valid for every call with the same tensors, `expected_m` and SM count.

    Contiguous GEMMs take the segments' ends (`psum`, DeepGEMM's "psum layout") where the
    release offers it, on SM90: its tiles then cover each expert's rows and stop. With
    `m_indices` alone its tiles cover the call's whole row bound, which holds up to 127 padding
    rows per expert: the bf16 kernel computes the tiles past the last segment and the fp8 kernel
    loads them (6-15% of a bf16 layer's time, 8% of Qwen3-30B-A3B's fp8 layer at 4096 tokens,
    on an H100: docs/device-runs/2026-11-25-session32)."""

    # Pass the segments' ends to DeepGEMM's contiguous GEMMs where it takes them (SM90; for A/Bs)
    psum_layout: ClassVar[bool] = True

    def __init__(self, fp8: bool, sm100: bool, replay_graphs: bool = True) -> None:
        import inspect

        from moehal.graphs import LaunchMemo

        dg = import_deep_gemm()
        self.fp8 = fp8
        names = _FP8_FNS if fp8 else _BF16_FNS
        self._masked = dg_fn(dg, names[0])
        self._contig = dg_fn(dg, names[1])
        self._kw: dict[str, Any] = {"recipe": (1, 1, 128)} if (fp8 and sm100) else {}
        try:
            params = inspect.signature(self._contig).parameters
        except (TypeError, ValueError):  # a C function without a signature: an older release
            params = {}
        # SM100 is left on `m_indices`: its psum path was never run here
        self.takes_psum = self.psum_layout and not sm100 and "use_psum_layout" in params
        # an engine may change DeepGEMM's SM count between calls (SGLang's overlap modes): key on it
        sms = getattr(dg, "get_num_sms", None)
        memo = lambda fn: LaunchMemo(fn, context=sms)  # noqa: E731
        self.memos = (memo(self._masked_call), memo(self._contig_call)) if replay_graphs else None
        # (None: call the method; a bound method kept here would make the ops a reference cycle)
        self._run_masked: Any = self.memos[0] if self.memos else None
        self._run_contig: Any = self.memos[1] if self.memos else None

    def masked(
        self, a: torch.Tensor, sa: Any, w: torch.Tensor, sw: Any, d: torch.Tensor, mm: torch.Tensor, em: int
    ) -> None:
        """`d[e, :mm[e]] = a[e, :mm[e]] @ w[e].T` per expert (`em`: DeepGEMM's expected rows hint)."""
        (self._run_masked or self._masked_call)(a, sa, w, sw, d, mm, em)

    def contiguous(
        self,
        a: torch.Tensor,
        sa: Any,
        w: torch.Tensor,
        sw: Any,
        d: torch.Tensor,
        layout: torch.Tensor,
        psum: torch.Tensor | None = None,
    ) -> None:
        """`d[r] = a[r] @ w[layout[r]].T` for rows with `layout[r] >= 0`. `psum` int32 `[E]`
        (where `takes_psum`): each expert's segment end, segment_start + counts; DeepGEMM
        then reads it in place of `layout`."""
        (self._run_contig or self._contig_call)(a, sa, w, sw, d, layout if psum is None else psum, psum is not None)

    def _masked_call(
        self, a: torch.Tensor, sa: Any, w: torch.Tensor, sw: Any, d: torch.Tensor, mm: torch.Tensor, em: int
    ) -> None:
        if self.fp8:
            self._masked((a, sa), (w, sw), d, mm, em, **self._kw)
        else:
            self._masked(a, w, d, mm, em)

    def _contig_call(
        self, a: torch.Tensor, sa: Any, w: torch.Tensor, sw: Any, d: torch.Tensor, layout: torch.Tensor, psum: bool
    ) -> None:
        kw = {**self._kw, "use_psum_layout": True} if psum else self._kw
        if self.fp8:
            self._contig((a, sa), (w, sw), d, layout, **kw)
        else:
            self._contig(a, w, d, layout, **kw)


# DeepGEMM's masked grouped GEMM computes and stores whole BLOCK_M tiles of each group: with
# max_m not a multiple of the tile, a group's last tile spills into the next group's rows
# (seen on 2 x H200, 2026-11-22: wrong outputs behind the EP dispatcher, max_m = 9). Its
# heuristic picks BLOCK_M from {64, 128} by `expected_m` (csrc/jit_kernels/heuristics/common.hpp,
# `MGroupedMasked`), so max_m must be a multiple of 128: at 64 (session 40's audit), an expert
# with more than max_m - 64 rows spilled whenever the heuristic chose 128-row tiles. The experts
# declare the alignment in their input format, so dispatchers size max_m for it.
MASKED_ROW_ALIGNMENT = 128


def check_masked_rows(max_m: int) -> None:
    if max_m % MASKED_ROW_ALIGNMENT:
        raise ValueError(
            f"masked input has max_m={max_m}, not a multiple of {MASKED_ROW_ALIGNMENT}: the dispatcher ignored the "
            "row_alignment these experts declared (DeepGEMM would write across experts)"
        )


class TorchGemmOps:
    """A float32 torch stand-in with DeepGEMM's contract (tests of the glue on CPU only):
    masked computes every row of every expert (as full tiles would); contiguous computes the
    rows whose expert id is >= 0 and leaves -1 rows untouched."""

    def __init__(self, fp8: bool) -> None:
        self.fp8 = fp8

    @staticmethod
    def _deq(x: torch.Tensor, s: Any, block: bool) -> torch.Tensor:
        from moehal.quant import fp8

        if s is None:
            return x.float()
        return fp8.dequantize_block(x, s) if block else fp8.dequantize_group(x, s)

    def masked(
        self, a: torch.Tensor, sa: Any, w: torch.Tensor, sw: Any, d: torch.Tensor, mm: torch.Tensor, em: int
    ) -> None:
        d.copy_(torch.einsum("emk,enk->emn", self._deq(a, sa, False), self._deq(w, sw, True)).to(d.dtype))

    takes_psum = False

    def contiguous(
        self,
        a: torch.Tensor,
        sa: Any,
        w: torch.Tensor,
        sw: Any,
        d: torch.Tensor,
        layout: torch.Tensor,
        psum: torch.Tensor | None = None,
    ) -> None:
        af, wf = self._deq(a, sa, False), self._deq(w, sw, True)
        for e in range(wf.shape[0]):
            rows = torch.nonzero(layout == e).flatten()
            if rows.numel():
                d[rows] = (af[rows] @ wf[e].t()).to(d.dtype)


MaskedGemm = Callable[[torch.Tensor, Any, torch.Tensor, Any, torch.Tensor, torch.Tensor, int], None]


# GEMM1 fused with the activation:
# (x, x scales, w13, w13 scales, w13_bias, GEMM2's static input scale, activation buffer, y, masked_m) -> None
FusedGemm1 = Callable[[torch.Tensor, Any, torch.Tensor, Any, Any, Any, Any, torch.Tensor, torch.Tensor], None]


# Fuse GEMM1 with the activation only for batches of at most this many rows per local expert
# (decode). Measured on an H100, same run, fused vs unfused (docs/device-runs/2026-11-22-session4):
# Qwen3-30B-A3B 47.5 vs 55.8 us at 1 token, 108.9 vs 119.7 at 4, 289.0 vs 298.6 at 16 (<= 1 row
# per expert), but 464.0 vs 447.2 at 128 tokens (8 rows per expert: the tile tuned for the plain
# GEMM runs worse with a second B tile); DeepSeek-V3 and Mixtral at 1-16 tokens within 1%.
FUSE_MAX_ROWS_PER_EXPERT = 2
# Prefill batches fuse with a prefill tile of their own where the device's table measured the
# whole layer at least MIN_GAIN faster that way (`GemmChooser.prefill_fused`): on an H100,
# Qwen3-30B-A3B at 2048-4096 tokens and Mixtral-8x7B at 1024 (3.6-5.9%); on an H200, Qwen3 at
# 2048 only (docs/device-runs/2026-11-23-session8).


def _fusable(choice: GemmChoice, config: MoEConfig, fp8: bool = False) -> bool:
    """Fuse where the table holds the fused kernel's own measured tile, or where the tuned GEMM1
    tile keeps its pipeline depth once it holds the up tile too (`fused_act_config` may shorten
    its K tile, not its stages; for fp8, an N tile wider than 128 columns grows to whole 1x128
    groups): elsewhere the fused kernel would run an untuned, shallower pipeline, and the
    unfused path is the measured one."""
    from moehal.kernels.triton_grouped_gemm import fused_act_config

    if choice.fused_config is not None:  # the fused kernel's own tile, measured
        return True
    cfg = choice.config
    if cfg is None:
        return False
    return fused_act_config(cfg, config.hidden_size, 1 if fp8 else 2, quant=fp8).num_stages == cfg.num_stages


def triton_masked_gemm_act(choice: GemmChoice, total_rows: int, config: MoEConfig, ue8m0: bool = False) -> FusedGemm1:
    """GEMM1 and the activation in one Triton kernel (layers whose GEMM1 runs on Triton): the
    GEMM1 output never goes through memory, and a decode step has one launch fewer. FP8
    layers' kernel quantizes its output for GEMM2 as the activation kernel would (1x128
    groups, `ue8m0` scales, or GEMM2's static input scale). The launch is bound on the first
    call and kept while the operands keep their shapes and weights (host time of an eager
    decode step; `MaskedGemmActLaunch.takes`)."""
    from moehal.kernels.triton_fused_moe import _ACTS
    from moehal.kernels.triton_grouped_gemm import Fp8Operands, MaskedGemmActLaunch, bind_masked_gemm_act

    tile = choice.fused_config or choice.config
    assert tile is not None
    act = _ACTS[config.activation.value]
    launch: MaskedGemmActLaunch | None = None

    def run(
        x: torch.Tensor, sx: Any, w13: torch.Tensor, sw13: Any, b13: Any, a2_scale: Any, act_buf: Any,
        y: torch.Tensor, mm: torch.Tensor,
    ) -> None:  # fmt: skip
        nonlocal launch
        if launch is None or not launch.takes(x, w13, b13, act_buf.hidden, y, sw13, a2_scale):
            fp8 = None
            if sw13 is not None:
                fp8 = Fp8Operands(sx, sw13, act_buf.scales, ue8m0, a2_scale)
            launch = bind_masked_gemm_act(
                x, w13, b13, act_buf.hidden, act_buf.expert_rows, y, total_rows, tile, activation=act,
                gated=config.gated, alpha=config.swiglu_alpha, limit=config.swiglu_limit, fp8=fp8,
            )  # fmt: skip
        launch(x, act_buf.hidden, act_buf.expert_rows, y, mm, sx, act_buf.scales)

    return run


def triton_masked_gemm(choice: GemmChoice, total_rows: int) -> MaskedGemm:
    """The Triton masked grouped GEMM with DeepGEMM's masked call signature, its launch bound
    on the first call and kept while the operands keep their shapes and weights
    (`MaskedGemmLaunch.takes`)."""
    from moehal.kernels.triton_grouped_gemm import MaskedGemmLaunch, bind_masked_grouped_gemm

    launch: MaskedGemmLaunch | None = None

    def run(a: torch.Tensor, sa: Any, w: torch.Tensor, sw: Any, d: torch.Tensor, mm: torch.Tensor, em: int) -> None:
        nonlocal launch
        if launch is None or not launch.takes(a, sa, w, d):
            launch = bind_masked_grouped_gemm(a, sa, w, sw, d, total_rows, choice.config)
            if launch is None:  # no rows
                return
        launch(a, sa, d, mm)

    return run


# Layers whose experts' weights for one token exceed this take the masked path at every size:
# there the token-major kernels save a fixed few microseconds of glue on a step of 175-245 us
# and measured within +-2.5% of the masked path (DeepSeek-V3's EP8 slice and Mixtral-8x7B, 704
# MB per token, on an H100 and an H200), while Qwen3-30B-A3B (75 MB) gained 10-35%.
SMALL_BATCH_MAX_BYTES_PER_TOKEN = 256 * 2**20


def small_batch_tokens(num_experts: int, top_k: int, bytes_per_token: int = 0) -> int:
    """Batches of at most this many tokens take the token-major decode kernels
    (`moehal.kernels.triton_token_moe`); 0: none. At one token no two slots share an expert,
    so grouping rows by expert saves no weight traffic and costs a permute and a gather; with
    more tokens, slots that share an expert read its weights once each. Measured on an H100
    and an H200 (docs/device-runs/2026-11-23-session6), token-major vs masked, whole layer:
    Qwen3-30B-A3B (E/K = 16) 1.15-1.35x at 1 token, 1.00-1.06x at 4, 0.92-1.06x at 6-16. So:
    E / (4 K) tokens, for layers of at most `SMALL_BATCH_MAX_BYTES_PER_TOKEN`."""
    if bytes_per_token > SMALL_BATCH_MAX_BYTES_PER_TOKEN:
        return 0
    return max(1, num_experts // (4 * max(top_k, 1)))


def portable_prefill_tokens(req: BuildRequest, override: int | None = None) -> tuple[int, int | None] | None:
    """The batch sizes (lo, hi; hi None: no bound) that run the portable Triton fused MoE in
    place of the grouped-GEMM pipeline (None: none), for bf16 and, on SM90, fp8 block-scale
    weights (the kernel reads DeepGEMM's fp32 `[E, N/128, K/128]` scales as they are; SM100's
    packed UE8M0 scales only DeepGEMM reads). `override` None: this device's table decides
    (`GemmChooser.portable_prefill_range`: whole-layer measurements per layer shape and scheme;
    in session 13 Qwen3-30B-A3B bf16 measured 1.03-1.09x faster that way at 64-4096 tokens on
    an H100 and 1.02-1.07x at 64-512 on an H200, where DeepGEMM pads each expert's rows to
    128-row tiles and the pipeline permutes, activates and combines in passes of their own,
    while DeepSeek-V3's EP8 slice and Mixtral-8x7B ran 21-28% slower); 0: never; n > 0: from n
    tokens up."""
    c = req.config
    kind = req.quant.kind
    if override == 0 or not (kind is QuantKind.BF16 or (kind is QuantKind.FP8_BLOCK and not _is_sm100(req))):
        return None
    if override is not None:
        return override, None
    if req.hardware.kind != "cuda":
        return None
    chooser = GemmChooser(req.hardware.name)
    dtype = "bf16" if kind is QuantKind.BF16 else "fp8_block"
    return chooser.portable_prefill_range(
        c.num_local_experts, c.hidden_size, c.intermediate_size, c.top_k, c.gated, dtype
    )


# fp8_tensor batches of at most this many tokens run the portable Triton fused MoE where this
# device's table has no measured band for the layer shape. Measured on an H100
# (docs/device-runs/2026-11-24-session21), whole layer, against the grouped GEMMs: 0.99-1.12x
# their speed at 16-128 tokens for Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3's EP8 slice
# (within 4% either way at 1 token), but 1.13-1.44x slower at 4096 tokens.
FP8_TENSOR_PORTABLE_MAX_TOKENS = 128


def fp8_tensor_portable_band(req: BuildRequest, override: int | None = None) -> tuple[int, int | None, str] | None:
    """The batch sizes (lo, hi; hi None: no bound) at which an fp8_tensor layer runs the
    portable Triton fused MoE on the per-expert scales in place of DeepGEMM's grouped GEMMs, and
    why (None: never). `override` None: this device's table decides where it measured the layer
    shape (`GemmChooser.portable_prefill_range`, records keyed `dtype=fp8_tensor`; where the
    portable kernel never won: never), else up to `FP8_TENSOR_PORTABLE_MAX_TOKENS`; 0: never;
    n > 0: up to n tokens."""
    if override == 0:
        return None
    if override is not None:
        return 1, override, "the portable Triton fused MoE on the per-expert scales (a set bound)"
    c = req.config
    if req.hardware.kind == "cuda":
        chooser = GemmChooser(req.hardware.name)
        dims = (c.num_local_experts, c.hidden_size, c.intermediate_size, c.top_k, c.gated, "fp8_tensor")
        if layer_key(*dims) in (chooser.table.get("prefill_portable") or {}):
            band = chooser.portable_prefill_range(*dims)
            why = "the portable Triton fused MoE on the per-expert scales, measured faster for this layer shape here"
            return None if band is None else (*band, why)
    why = "the portable Triton fused MoE on the per-expert scales, measured faster at decode sizes on an H100"
    return 1, FP8_TENSOR_PORTABLE_MAX_TOKENS, why


def plan_masked(
    config: MoEConfig,
    fp8: bool,
    chooser: GemmChooser | None,
    e: int,
    bound: int,
    fuse_bf16: bool = True,
    fuse_fp8: bool | None = None,
) -> tuple[GemmChoice, GemmChoice, GemmChoice | None]:
    """What the masked path runs for a batch of at most `bound` rows over `e` local experts:
    (GEMM1, GEMM2, GEMM1 fused with the activation or None; when fused, it replaces GEMM1 and
    the activation kernel). Pure: the runner builds its launches from it, and `tuned_shapes`
    asks it which batch sizes reach which kernels.

    bf16 layers whose GEMM1 runs on Triton at decode sizes fuse it with the activation where
    the tile allows (`_fusable`); at prefill sizes, where the table measured the whole layer
    faster fused (`GemmChooser.prefill_fused`). FP8 layers fuse (the kernel also quantizes
    GEMM2's input) where `fuse_fp8` says so: None, where the table measured the whole layer
    faster fused (`GemmChooser.decode_fused`); True, wherever GEMM1 runs on Triton at decode
    sizes; False, never."""
    c = config
    tokens = max(1, -(-bound // c.top_k))
    dtype = "fp8_block" if fp8 else "bf16"  # fp8_tensor: the same GEMMs on block scales
    shapes = ((c.w13_rows, c.hidden_size), (c.hidden_size, c.intermediate_size))
    g1, g2 = (chooser.choose(e, n, k, dtype, tokens) if chooser is not None else DEEPGEMM for n, k in shapes)
    few_rows = bound <= FUSE_MAX_ROWS_PER_EXPERT * e
    if fp8:
        if not few_rows or not g1.triton:
            return g1, g2, None
        fuse, tile = fuse_fp8, None
        if fuse is None:  # the device's whole-layer measurements decide
            measured = chooser.decode_fused(e, c.w13_rows, c.hidden_size, "fp8_block", tokens) if chooser else None
            fuse, tile = measured or (False, None)
        if not fuse:
            return g1, g2, None
        if tile is not None:
            return g1, g2, replace(g1, fused_config=tile)
        return g1, g2, (g1 if _fusable(g1, c, fp8=True) else None)
    if not fuse_bf16:
        return g1, g2, None
    if g1.triton and few_rows:
        return g1, g2, (g1 if _fusable(g1, c) else None)
    if c.gated and chooser is not None:  # prefill: where the table measured the whole layer faster fused
        tile = chooser.prefill_fused(e, c.w13_rows, c.hidden_size, tokens)
        if tile is not None:
            return g1, g2, GemmChoice("triton", tile, tokens, fused_config=tile)
    return g1, g2, None


def _in_table(chooser: GemmChooser, c: MoEConfig, quant: QuantScheme) -> bool:
    """Whether the device's table holds anything for this layer shape and scheme: a GEMM's
    entry or a whole-layer record."""
    t = chooser.table
    dtype = "fp8_block" if quant.kind in _FP8_KINDS else "bf16"
    e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    gemm1, gemm2 = entry_key(e, c.w13_rows, h, dtype), entry_key(e, h, i, dtype)
    layer = layer_key(e, h, i, c.top_k, c.gated, "fp8_tensor" if quant.kind is QuantKind.FP8_TENSOR else dtype)
    records = ("prefill_portable", "prefill_fused", "decode_fused")
    return bool({gemm1, gemm2} & set(t.get("entries", {}))) or any(
        layer in t.get(rec, {}) or gemm1 in t.get(rec, {}) for rec in records
    )


def _path_of(
    req: BuildRequest,
    small: SmallBatchFormat | None,
    chooser: GemmChooser,
    portable: Callable[[int], object],
    tokens: int,
) -> object:
    """What a batch of `tokens` runs, as `DeepGemmExpertsRunner.apply` decides it on one GPU
    (`tuned_shapes`): the token-major decode kernels (their split of the top-k sum changes
    with the count), the portable fused MoE's tiles, or the masked plan (`plan_masked`)."""
    c, r = req.config, DeepGemmExpertsRunner
    static = req.quant.kind is QuantKind.FP8_TENSOR  # its small batches run the portable kernel
    if small is not None and small.takes(tokens):
        return ("token-major", tokens) if tokens <= small.max_tokens and not static else portable(tokens)
    fp8 = req.quant.kind in _FP8_KINDS
    fusion = (r.fuse_gemm1_activation, r.fuse_fp8_gemm1_activation)
    plan = plan_masked(c, fp8, chooser, c.num_local_experts, tokens * c.top_k, *fusion)
    # the kernels and tiles, not the measured count a choice came from
    return tuple(None if g is None else (g.use, g.config, g.fused_config) for g in plan)


# --- runner ---------------------------------------------------------------------------------------


class DeepGemmExpertsRunner(ExpertsRunner):
    """chooser: per-shape, per-token-count choice between DeepGEMM's masked GEMM and the tuned
    Triton one (`moehal_cuda.gemm_choice`); None = DeepGEMM always."""

    # bf16 layers whose GEMM1 runs on Triton run it fused with the activation (class-level so a
    # benchmark can compare both; the unfused path is what DeepGEMM GEMM1s always take)
    fuse_gemm1_activation: ClassVar[bool] = True
    # The same for FP8 layers (fp8_block, fp8_tensor), whose fused kernel also quantizes GEMM2's
    # input: None (the default), where the device's table measured the whole layer faster fused
    # (`GemmChooser.decode_fused`; unrestricted, it ranged from 10% faster to 24% slower by shape,
    # size and tile on an H200: docs/device-runs/2026-11-25-session31); True, wherever GEMM1 runs
    # on Triton at decode sizes; False, never.
    fuse_fp8_gemm1_activation: ClassVar[bool | None] = None

    def __init__(
        self,
        req: BuildRequest,
        fmt: ActivationFormat,
        ops: Any,
        chooser: GemmChooser | None = None,
        small: SmallBatchFormat | None = None,
    ) -> None:
        self.fmt, self.req, self.config, self.ops = fmt, req, req.config, ops
        # token-major batches above the decode range are prefill batches (the portable fused MoE)
        prefill = small is not None and small.prefill_min_tokens is not None
        self.decode_max_tokens = small.max_tokens if small is not None and prefill else sys.maxsize
        self._portable: Any = None  # the portable fused MoE's runner, on these weights
        self._tokens: Any = None  # the token-major decode kernels (`TokenMoE`), on these weights
        self._masked_buffers: dict[tuple[int, int], tuple[Any, Any, Any]] = {}  # (E, max_m) -> workspaces
        self._activations: dict[tuple[int, int, int], Any] = RecentBinds()  # (rows bound, E, max_m) -> activation
        self.fp8 = req.quant.kind in _FP8_KINDS
        self.static = req.quant.kind is QuantKind.FP8_TENSOR  # static activation scales
        self.ue8m0 = req.quant.scale_format is ScaleFormat.UE8M0
        self.w: DeepGemmWeights | None = None
        self.chooser = chooser
        # total-rows bound -> (GEMM1, GEMM2, fused GEMM1 + activation or None) callables and the
        # choices behind them; filled on first sight of a batch size: one dict lookup a forward
        # (the recent sizes only: a stream of prefill sizes would grow them without bound).
        self._masked: dict[int, tuple[MaskedGemm, MaskedGemm, FusedGemm1 | None]] = RecentBinds()
        self.masked_choices: dict[int, tuple[GemmChoice, GemmChoice]] = RecentBinds()

    def _masked_gemms(self, inp: MaskedInput) -> tuple[MaskedGemm, MaskedGemm, FusedGemm1 | None]:
        bound = inp.total_rows_bound
        gemms = self._masked.get(bound)
        if gemms is None:
            e = inp.hidden.shape[0]
            fuse = (self.fuse_gemm1_activation, self.fuse_fp8_gemm1_activation)
            g1c, g2c, fused_c = plan_masked(self.config, self.fp8, self.chooser, e, bound, *fuse)
            self.masked_choices[bound] = (fused_c or g1c, g2c)
            g1, g2 = (triton_masked_gemm(ch, bound) if ch.triton else self.ops.masked for ch in (g1c, g2c))
            fused = triton_masked_gemm_act(fused_c, bound, self.config, self.ue8m0) if fused_c is not None else None
            gemms = self._masked[bound] = (g1, g2, fused)
        return gemms

    def _masked_activation(self, inp: MaskedInput, bufs: tuple[Any, Any, Any]) -> Any:
        """The activation's launch on the masked workspaces `bufs` for this batch's row bound,
        bound once per (bound, E, max_m) (host time of an eager step): the buffers are kept per
        shape, the weights until the next `load`."""
        e, m, _ = inp.hidden.shape
        key = (inp.total_rows_bound, e, m)
        launch = self._activations.get(key)
        if launch is None:
            from moehal_cuda.triton_glue import RowIndex, bind_activation

            w = self.w
            assert w is not None
            hb, ab, yb = bufs
            rows = RowIndex(e * m, m, masked_m=inp.masked_m, total_rows=inp.total_rows_bound)
            launch = bind_activation(
                hb.hidden, ab, yb.hidden, rows, self.config, w.w13_bias, self.ue8m0, static_scale=w.a2_scale
            )
            self._activations[key] = launch
        return launch

    def _apply_tokens(self, inp: StandardInput, out: torch.Tensor | None = None) -> StandardOutput:
        """The small-batch format: token-major, two kernels, the router weights and the routed
        scaling applied in the second (see `moehal.kernels.triton_token_moe`), which writes the
        layer's result: into `out` when the caller gave one."""
        tokens = self._tokens if self._tokens is not None else self._bind_tokens()
        x = inp.hidden
        if out is None:
            out = torch.empty(x.shape[0], self.config.hidden_size, dtype=self.config.dtype, device=x.device)
        wts = inp.topk_weights if inp.topk_weights.is_contiguous() else inp.topk_weights.contiguous()
        return StandardOutput(tokens(x, inp.topk_ids, wts, out), scaled=True)

    def _bind_tokens(self, **extra: Any) -> Any:
        """The decode kernels on these weights, tiles and checks decided once per token count
        (`TokenMoE`; host time of an eager decode step). extra: `TokenMoE`'s optional arguments
        (the NVFP4 experts' output scales and activation quantizer)."""
        from moehal.kernels.triton_fused_moe import _ACTS
        from moehal.kernels.triton_token_moe import TokenMoE

        w, c = self.w, self.config
        assert w is not None
        self._tokens = TokenMoE(
            w.w13, w.w13_bias, w.w2, w.w2_bias, activation=_ACTS[c.activation.value], gated=c.gated,
            alpha=c.swiglu_alpha, limit=c.swiglu_limit, scaling=c.routed_scaling_factor, **extra,
        )  # fmt: skip
        return self._tokens

    def _apply_portable(self, inp: StandardInput, out: torch.Tensor | None = None) -> StandardOutput:
        """Prefill batches in the small-batch format: the portable Triton fused MoE (it gathers
        rows by expert inside GEMM1, fuses the activation, quantizes fp8 activations in 1x128
        groups itself, and weights and sums the top-k rows), run by its own experts runner on
        the same tensors as the grouped GEMMs: no second copy of the weights or their scales."""
        if self._portable is None:
            from moehal.kernels.triton_experts import TritonExpertsRunner
            from moehal.kernels.triton_fused_moe import TritonMoEWeights

            w = self.w
            assert w is not None
            # Kept only once loaded: a build that raises midway (an OOM in `.contiguous()`) must
            # not leave a runner without weights for every later portable batch.
            portable = TritonExpertsRunner(self.req, ActivationFormat(Layout.STANDARD, self.config.dtype))
            if self.static:  # fp8_tensor: per-expert scales (a block of each expert's) and the static ones
                assert w.w13_scale is not None and w.w2_scale is not None
                tw = TritonMoEWeights(
                    w.w13, w.w2, quant="fp8_tensor", w13_scale=w.w13_scale[:, 0, 0].contiguous(),
                    w2_scale=w.w2_scale[:, 0, 0].contiguous(), w13_bias=w.w13_bias, w2_bias=w.w2_bias,
                    a13_scale=w.a13_scale, a2_scale=w.a2_scale,
                )  # fmt: skip
            else:
                tw = TritonMoEWeights(
                    w.w13, w.w2, quant="fp8_block" if self.fp8 else "none", w13_scale=w.w13_scale,
                    w2_scale=w.w2_scale, w13_bias=w.w13_bias, w2_bias=w.w2_bias, ue8m0=self.ue8m0,
                )  # fmt: skip
            portable.load(tw)
            self._portable = portable
        return self._portable.apply(inp) if out is None else self._portable.apply_into(inp, out)

    def load(self, weights: Any) -> None:
        if isinstance(weights, ExpertWeights):  # canonical weights given directly (tests, no processor)
            sm100 = _is_sm100(self.req)
            weights = prepare_weights(weights, self.req.quant, sm100, import_deep_gemm() if sm100 else None)
        self.w = weights
        self._portable = None
        self._tokens = None
        self._masked.clear()  # their bound launches hold the previous weights
        self._activations.clear()

    def _buffers(self, lead: tuple[int, ...], device: torch.device) -> tuple[Any, Any, Any]:
        from moehal.kernels.triton_permute import contiguous_workspace, workspace
        from moehal_cuda.triton_glue import activation_chunks

        c = self.config
        i, h, n13 = c.intermediate_size, c.hidden_size, c.w13_rows
        act_dt = torch.float8_e4m3fn if self.fp8 else c.dtype
        tag = f"{n13}:{i}:{h}"
        # The activation buffer's record of written rows also decides which stale rows of y get
        # zeroed, so y must pair with exactly one activation buffer: key it by the act dtype too
        # (a bf16 and an fp8 layer of one shape, e.g. MTP draft and main layers, would otherwise
        # share y but not the bitmap, and stale rows one wrote would survive the other's calls).
        roles = ((f"dg.h:{tag}", n13, c.dtype, False, 1), (f"dg.act:{tag}", i, act_dt, self.fp8, activation_chunks(i)))
        roles += ((f"dg.y:{tag}:{act_dt}", h, c.dtype, False, 1),)
        if len(lead) == 2:  # masked
            return tuple(workspace(r, lead, cols, dt, device, q, b) for r, cols, dt, q, b in roles)  # type: ignore[return-value]
        # contiguous: this call's rows of buffers sized once for max_tokens (as the dispatcher's)
        m = lead[0]
        cap = self.contiguous_capacity(m)
        return tuple(contiguous_workspace(r, m, cap, cols, dt, device, q, b) for r, cols, dt, q, b in roles)  # type: ignore[return-value]

    def contiguous_capacity(self, rows: int) -> int:
        """Rows to allocate contiguous buffers with: the dispatcher's worst case at max_tokens.
        Behind an expert-parallel group a rank receives up to ep_size * max_tokens tokens, each
        with at most min(top_k, local experts) rows here."""
        from moehal.permute import contiguous_rows

        c = self.config
        if c.max_tokens is None:  # 0: `contiguous_workspace` rounds each call's rows to a power of two
            return 0
        ranks = c.ep_size if self.req.process_group is not None else 1
        slots = c.max_tokens * ranks * min(c.top_k, c.num_local_experts)
        return contiguous_rows(slots, c.num_local_experts, self.fmt.row_alignment)

    def _empty_output(self, inp: Any) -> Any:
        """No rows (0 tokens, or an EP rank that received none): DeepGEMM rejects empty operands
        (their strides), and there is nothing to compute."""
        shape = (*inp.hidden.shape[:-1], self.config.hidden_size)
        empty = torch.zeros(shape, dtype=self.config.dtype, device=inp.hidden.device)
        return MaskedOutput(empty) if isinstance(inp, MaskedInput) else ContiguousOutput(empty)

    def apply_into(self, inp: Any, out: torch.Tensor) -> Any:
        """Token-major batches write the layer's result into `out`; the grouped layouts' output
        is per expert row, which the dispatcher's combine then writes into `out`."""
        if isinstance(inp, StandardInput) and inp.hidden.shape[0]:
            t = inp.hidden.shape[0]
            portable = self.static or t > self.decode_max_tokens  # the decode kernels read bf16 weights only
            return self._apply_portable(inp, out) if portable else self._apply_tokens(inp, out)
        return self.apply(inp)

    def apply(self, inp: Any) -> Any:
        w = self.w
        assert w is not None, "weights not loaded"
        if isinstance(inp, StandardInput):
            t = inp.hidden.shape[0]
            if t == 0:
                return StandardOutput(inp.hidden.new_zeros(0, self.config.hidden_size), scaled=True)
            portable = self.static or t > self.decode_max_tokens
            return self._apply_portable(inp) if portable else self._apply_tokens(inp)
        if inp.hidden.numel() == 0:
            return self._empty_output(inp)
        if isinstance(inp, MaskedInput):
            e, m, _ = inp.hidden.shape
            bufs = self._masked_buffers.get((e, m))
            if bufs is None:  # once per buffer shape: the workspaces are persistent (host time)
                check_masked_rows(m)
                bufs = self._masked_buffers[(e, m)] = self._buffers((e, m), inp.hidden.device)
            hb, ab, yb = bufs
            gemm1, gemm2, gemm1_act = self._masked_gemms(inp)
            if gemm1_act is not None:
                x, sx, mm = inp.hidden, inp.scales, inp.masked_m
                gemm1_act(x, sx, w.w13, w.w13_scale, w.w13_bias, w.a2_scale, ab, yb.hidden, mm)
            else:
                gemm1(inp.hidden, inp.scales, w.w13, w.w13_scale, hb.hidden, inp.masked_m, inp.expected_m)
                self._masked_activation(inp, bufs)(inp.masked_m)
            gemm2(ab.hidden, ab.scales, w.w2, w.w2_scale, yb.hidden, inp.masked_m, inp.expected_m)
            if w.w2_bias is not None:
                from moehal_cuda.triton_glue import RowIndex, add_bias

                rows = RowIndex(e * m, m, masked_m=inp.masked_m, total_rows=inp.total_rows_bound)
                add_bias(yb.hidden, w.w2_bias, rows)
            return MaskedOutput(yb.hidden)
        from moehal_cuda.triton_glue import RowIndex, activation, add_bias

        if isinstance(inp, ContiguousInput):
            m, dev = inp.hidden.shape[0], inp.hidden.device
            hb, ab, yb = self._buffers((m,), dev)
            rows = RowIndex(m, 0, row_expert=inp.row_expert, segment_start=inp.segment_start, counts=inp.counts)
            psum = None
            if self.ops.takes_psum:  # the segments' ends, in a persistent tensor (graph memos key on it)
                from moehal.kernels.triton_permute import scratch

                c = self.config
                role = f"dg.psum:{c.w13_rows}:{c.intermediate_size}:{c.hidden_size}"  # per layer shape, as _buffers
                psum = scratch(role, tuple(inp.counts.shape), torch.int32, dev)
                torch.add(inp.segment_start, inp.counts, out=psum)
            self.ops.contiguous(inp.hidden, inp.scales, w.w13, w.w13_scale, hb.hidden, inp.row_expert, psum)
            activation(hb.hidden, ab, yb.hidden, rows, self.config, w.w13_bias, self.ue8m0, static_scale=w.a2_scale)
            self.ops.contiguous(ab.hidden, ab.scales, w.w2, w.w2_scale, yb.hidden, inp.row_expert, psum)
            if w.w2_bias is not None:
                add_bias(yb.hidden, w.w2_bias, rows)
            return ContiguousOutput(yb.hidden)
        raise TypeError(f"DeepGEMM experts cannot take {type(inp).__name__}")


def masked_workspace_bytes(req: BuildRequest) -> int:
    """Bytes of the masked path's worst-case buffers at `max_tokens`: the dispatched input,
    the GEMM1 output, the activation and the GEMM2 output, each `[E, max_m, cols]`.

    max_m is the dispatcher's: `max_tokens` rows per expert in one process, and `max_tokens x
    ep_size` behind an expert-parallel dispatcher (a process group), since every rank may send
    its whole batch to one expert (moehal's EP dispatcher and DeepEP low latency size it so)."""
    c = req.config
    if c.max_tokens is None:
        raise ValueError("masked buffers are unbounded without MoEConfig.max_tokens")
    from moehal.permute import masked_rows

    act = 1 if req.quant.kind in _FP8_KINDS else c.dtype.itemsize
    senders = c.ep_size if req.process_group is not None else 1
    max_m = masked_rows(c.max_tokens * senders, MASKED_ROW_ALIGNMENT)
    per_row = c.hidden_size * act + c.w13_rows * c.dtype.itemsize + c.intermediate_size * act
    per_row += c.hidden_size * c.dtype.itemsize
    return c.num_local_experts * max_m * per_row


_log = logging.getLogger(__name__)
_NOTED: set[tuple[Any, ...]] = set()


def _masked_fits(req: BuildRequest) -> bool:
    """Whether the masked layout's worst-case buffers fit the settings' budget (`max_tokens` set)."""
    mt = req.config.max_tokens
    return mt is not None and masked_workspace_bytes(req) <= req.settings.masked_workspace_gib * 2**30


def _note_contiguous(req: BuildRequest) -> None:
    """Say once per layer configuration why DeepGEMM's experts were built for the contiguous
    layout, the slower one at every batch size measured, where the masked budget chose it: an
    operator saw only `contiguous[...]` in the plan, with nothing naming the budget or the
    missing `max_tokens` behind it. Called at build (the plan is final then), not while
    selection or `moehal explain` ask which formats the kernel takes."""
    c, gib = req.config, req.settings.masked_workspace_gib
    key = (c, req.quant, gib, req.process_group is not None)
    if key in _NOTED or not _log.isEnabledFor(logging.INFO) or _masked_fits(req):
        return
    _NOTED.add(key)
    if c.max_tokens is None:
        why = "MoEConfig.max_tokens is unset, and masked buffers are sized for the worst case at max_tokens"
    else:
        need = masked_workspace_bytes(req) / 2**30
        why = (
            f"its masked buffers at max_tokens={c.max_tokens} would take {need:.2f} GiB, over the "
            f"masked_workspace_gib budget of {gib:g} GiB (MOEHAL_MASKED_WORKSPACE_GIB raises it)"
        )
    _log.info("cuda.deepgemm runs the contiguous layout for %s, %s: %s", c.describe(), req.quant, why)


class DeepGemmExperts(Experts):
    """DeepGEMM m-grouped GEMMs (masked and contiguous), BF16 and FP8 1x128/128x128 block scales
    (FP8 per-tensor as block scales that are all one value, on SM90)."""

    name = "deepgemm"
    priority = 20
    description = (
        "DeepGEMM m-grouped GEMMs (masked/contiguous; a tuned Triton masked GEMM where measured faster), "
        "BF16, FP8 block-scale and (SM90) FP8 per-tensor with static activation scales, Triton glue"
    )
    devices = frozenset({"cuda"})
    quant_schemes = frozenset({BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_TENSOR})
    supports_non_gated = True
    supports_bias = True
    graph_capturable = True
    weight_layout: ClassVar[str] = LAYOUT
    # batches of at most this many tokens run the token-major decode kernels; None: the rule of
    # `small_batch_tokens`, 0: never (class-level, so a benchmark can compare both paths)
    small_batch_max_tokens: ClassVar[int | None] = None
    # batches of at least this many tokens run the portable Triton fused MoE (bf16, SM90 fp8); None: where
    # this device's table measured it faster (`GemmChooser.portable_prefill_range`), 0: never
    portable_prefill_min_tokens: ClassVar[int | None] = None
    # fp8_tensor batches of at most this many tokens run the portable Triton fused MoE; None:
    # where this device's table measured it faster, else `FP8_TENSOR_PORTABLE_MAX_TOKENS`
    # (`fp8_tensor_portable_band`); 0: never
    fp8_tensor_portable_max_tokens: ClassVar[int | None] = None

    def check_hardware(self, req: BuildRequest) -> Decision:
        d = sm_decision(req, SUPPORTED_SM, "DeepGEMM")
        return deep_gemm_device_decision(req) if d.ok else d

    def check_libraries(self, req: BuildRequest) -> Decision:
        d = triton_decision()
        if not d.ok:
            return d
        fns = _LAYOUT_FNS + (_FP8_FNS if req.quant.kind in _FP8_KINDS else _BF16_FNS)
        return deep_gemm_decision(fns)

    def check_quant(self, req: BuildRequest) -> Decision:
        d = super().check_quant(req)
        if d.ok and _is_sm100(req) and req.quant == FP8_BLOCK:
            return decline(
                "DeepGEMM on SM100 consumes UE8M0 (power-of-two) scales; use quant fp8_block:ue8m0 "
                "(requantize the checkpoint's scales) so results match the scheme",
                "quant",
            )
        if d.ok and _is_sm100(req) and req.quant == FP8_TENSOR:
            return decline(
                "DeepGEMM on SM100 reads UE8M0 (power-of-two) scales, and a per-tensor scale is not one; "
                "the TensorRT-LLM fp8_tensor MoE serves SM100",
                "quant",
            )
        return d

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.dtype != torch.bfloat16:
            return decline(f"DeepGEMM writes bf16 outputs; the layer dtype is {c.dtype}", "shape")
        mult = 128 if req.quant.kind in _FP8_KINDS else 64
        for name, v in (("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size)):
            if v % mult:
                return decline(f"{name}={v} must be a multiple of {mult} (the GEMM K dimension)", "shape")
        return accept(predicate="shape")

    def _alignment(self) -> int:
        dg = import_deep_gemm()
        return int(dg_fn(dg, _LAYOUT_FNS[0])())

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        q = req.quant
        if q.kind is QuantKind.FP8_BLOCK:
            kind = ScaleKind.GROUP_128_UE8M0 if q.scale_format is ScaleFormat.UE8M0 else ScaleKind.GROUP_128
            dtype = torch.float8_e4m3fn
        elif q.kind is QuantKind.FP8_TENSOR:  # the checkpoint's static scale, in 1x128 groups' slots
            kind, dtype = ScaleKind.STATIC_TENSOR, torch.float8_e4m3fn
        else:
            kind, dtype = ScaleKind.NONE, req.config.dtype
        masked = ActivationFormat(Layout.MASKED, dtype, kind, MASKED_ROW_ALIGNMENT)
        contig = ActivationFormat(Layout.CONTIGUOUS, dtype, kind, self._alignment())
        # Masked is faster at every batch size measured on an H100 (docs/device-runs/: e.g. 930 vs
        # 1057 us for Qwen3-30B-A3B at 4096 tokens), but its buffers are sized for the worst case
        # (every token at one expert): prefer it while they fit the settings' budget.
        return [masked, contig] if _masked_fits(req) else [contig, masked]

    def small_batch_format(self, req: BuildRequest) -> SmallBatchFormat | None:
        """bf16 (and fp16) layers take token-major input at decode sizes: two Triton kernels
        for the whole layer, no permute and no gather (`moehal.kernels.triton_token_moe`); bf16
        and SM90 fp8 layers also at prefill sizes where this device's table measured the
        portable Triton fused MoE faster for this layer shape (`portable_prefill_tokens`). The
        input is unquantized either way: the portable kernel quantizes fp8 activations itself."""
        c = req.config
        if req.quant.kind is QuantKind.FP8_TENSOR:
            fp8t = fp8_tensor_portable_band(req, self.fp8_tensor_portable_max_tokens)
            if fp8t is None:
                return None
            fmt = ActivationFormat(Layout.STANDARD, c.dtype)
            lo, hi, why = fp8t
            if lo <= 1 and hi is not None:  # a decode range
                return SmallBatchFormat(fmt, hi, why)
            return SmallBatchFormat(fmt, 0, "", lo, why, hi)  # a band of sizes only
        band = portable_prefill_tokens(req, self.portable_prefill_min_tokens)
        if req.quant.kind is not QuantKind.BF16:
            n = 0  # the decode kernels read bf16 weights only
        else:
            per_token = c.top_k * (c.w13_rows + c.intermediate_size) * c.hidden_size * c.dtype.itemsize  # w13 + w2
            n = self.small_batch_max_tokens
            if n is None:
                n = small_batch_tokens(c.num_local_experts, c.top_k, per_token)
        if n == 0 and band is None:
            return None
        fmt = ActivationFormat(Layout.STANDARD, c.dtype)
        why = "token-major decode kernels: no permute, no gather" if n else "no decode batch runs token-major"
        if band is None:
            return SmallBatchFormat(fmt, n, why)
        prefill_why = "the portable Triton fused MoE, measured faster here for this layer shape"
        return SmallBatchFormat(fmt, n, why, band[0], prefill_why, band[1])

    def tuned_shapes(self, req: BuildRequest) -> Sequence[TunedShape]:
        """The benchmark's model shapes (`moehal.bench.SHAPES`, those `moehal_cuda.tuning`
        tunes) that this device's table holds, per scheme this device runs, each with the
        smallest batch size of every distinct path from 1 to `moehal.bench.TUNED_MAX_TOKENS` tokens: the
        token-major decode kernels, the portable fused MoE's band, and each masked plan
        (`plan_masked`: DeepGEMM or a tuned Triton GEMM per GEMM, and any fused GEMM1)."""
        if req.hardware.kind != "cuda":
            return ()
        chooser = GemmChooser(req.hardware.name)
        if not chooser.has_table:
            return ()
        from moehal.bench import model_requests  # the shapes the tables are tuned for
        from moehal.kernels.triton_experts import portable_tiles

        out: list[TunedShape] = []
        for name, r in model_requests(self, req):
            if not _in_table(chooser, r.config, r.quant):
                continue  # DeepGEMM at every size, as at conformance's small shapes
            path_of = functools.partial(_path_of, r, self.small_batch_format(r), chooser, portable_tiles(r))
            out.append(TunedShape.covering(name, r.config, r.quant, path_of, f"the tables of {req.hardware.name}"))
        return out

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        fp8 = req.quant.kind in _FP8_KINDS
        sm100 = _is_sm100(req)
        # SM100 FP8 weight scales are packed UE8M0, which only DeepGEMM reads.
        chooser = None if (fp8 and sm100) else GemmChooser(req.hardware.name)
        ops = DeepGemmOps(fp8, sm100)  # first: a build that fails here claims no GPU
        claim_deep_gemm_device(req)
        if fmt.layout is Layout.CONTIGUOUS:
            _note_contiguous(req)
        return DeepGemmExpertsRunner(req, fmt, ops, chooser, self.small_batch_format(req))
