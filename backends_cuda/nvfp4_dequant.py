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
GEMMs here (`moehal.kernels.triton_grouped_gemm`), masked and contiguous, on DeepGEMM's layouts;
the biases go into their epilogues too (x @ w^T x scale + b, rounded once, as the reference).
Since session 50 these experts need Triton only, not DeepGEMM: an install without
sgl-deep-gemm (whose wheels are tied to one torch release) still runs NVFP4 checkpoints on
Hopper. The component keeps its name (`deepgemm_nvfp4_dequant`): engines may pin it.

Costs: weights take 4x the memory of FP4 (BF16), and the GEMMs run at the BF16 rate of Triton
tiles (the device's tuned table's, for the shapes it holds). It is a compatibility path: on
SM100 the FlashInfer CuteDSL NVFP4 experts (FP4 tensor cores) win.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    SmallBatchFormat,
    StandardInput,
    StandardOutput,
)
from moehal.interfaces import BuildRequest, ExpertsRunner, TunedShape, WeightProcessor
from moehal.kernels.host import RecentBinds
from moehal.kernels.tiles import TileConfig
from moehal.quant import NVFP4, nvfp4
from moehal.weights import ExpertWeights
from moehal_cuda.deepgemm_experts import (
    MASKED_ROW_ALIGNMENT,
    SUPPORTED_SM,
    DeepGemmExperts,
    DeepGemmExpertsRunner,
    DeepGemmWeights,
    check_masked_rows,
    small_batch_tokens,
)
from moehal_cuda.gemm_choice import GemmChooser
from moehal_cuda.support import sm_decision, triton_decision

LAYOUT = "deepgemm_nvfp4_dequant"
# Contiguous segments start at multiples of this many rows: DeepGEMM's SM90 alignment, which the
# layouts these experts share with DeepGEMM's keep, and the Triton GEMM's largest row tile.
CONTIGUOUS_ROW_ALIGNMENT = 128
# Row counts whose GEMM tiles a runner keeps (`Nvfp4DequantRunner.tile_configs`): a stream of
# prefill sizes keeps this many (two table lookups, ~25 us of host time per contiguous call).
TILE_MEMO = 64


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


def _block_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes `[E, N, K/2]` and block scales -> `[E, N, K]` of `dtype`, one expert at a time
    into one allocation (a list of per-expert results, then a stack, held one more copy of the
    layer's largest tensor at load)."""
    out: torch.Tensor | None = None
    for e, (q, s) in enumerate(zip(codes, scales, strict=True)):
        v = nvfp4.block_values(q, s)
        if out is None:
            out = torch.empty((codes.shape[0], *v.shape), dtype=dtype, device=v.device)
        out[e].copy_(v)
    assert out is not None, "no experts"
    return out


def dequantize_nvfp4_weights(weights: ExpertWeights, dtype: torch.dtype) -> DequantNvfp4Weights:
    assert weights.w13_scale is not None and weights.w2_scale is not None
    assert weights.w13_global_scale is not None and weights.w2_global_scale is not None
    assert weights.a13_scale is not None and weights.a2_scale is not None
    w13 = _block_values(weights.w13, weights.w13_scale, dtype)
    w2 = _block_values(weights.w2, weights.w2_scale, dtype)
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
    description = "NVFP4 -> bf16 codes x block scales (exact) and per-expert global-scale factors, once (Hopper)"
    priority = 10
    devices = frozenset({"cuda"})
    quant_schemes = frozenset({NVFP4})

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        return dequantize_nvfp4_weights(weights, req.config.dtype)


class Nvfp4DequantRunner(DeepGemmExpertsRunner):
    """tiles: the device's tuned table (`moehal_cuda.gemm_choice`), whose bf16 rows measured
    Triton tiles for these GEMM shapes (the operands are bf16); None, or a shape or device it
    has no row for: `default_config`'s untuned tiles."""

    # class-level so a benchmark can compare both (tools/bench_ab.py --variants nvfp4-untuned)
    tuned_tiles: ClassVar[bool] = True
    # False: masked batches bind their quantizer and activation launches anew on every call, as
    # before session 52 (tools/bench_ab.py --variants nvfp4-rebind-masked)
    keep_masked_glue: ClassVar[bool] = True

    def __init__(self, req: BuildRequest, fmt: Any, ops: Any = None, tiles: GemmChooser | None = None) -> None:
        super().__init__(req, fmt, ops)  # ops: unused (no DeepGEMM call); tests pass a stand-in
        self.tiles = tiles
        # masked batches: total-rows bound -> the two GEMMs' bound launches (host time of an
        # eager step), kept while they take this call's buffers (`MaskedGemmLaunch.takes`)
        self._launches: dict[int, tuple[Any, Any]] = RecentBinds()
        self._tile_memo: dict[int, tuple[TileConfig | None, TileConfig | None]] = {}  # `tile_configs`
        # (tokens, device) -> the input quantizer's bound launch and the rows it writes
        self._input_quant: dict[tuple[int, torch.device], tuple[Any, torch.Tensor]] = {}
        # masked batches: (rows bound, E, max_m) -> the quantizer's and activation's bound
        # launches and their workspaces (`_masked_glue`)
        self._glue: dict[tuple[int, int, int], tuple[Any, Any, tuple[torch.Tensor, Any, Any, Any]]] = RecentBinds()

    def load(self, weights: Any) -> None:
        if isinstance(weights, ExpertWeights):
            weights = dequantize_nvfp4_weights(weights, self.config.dtype)
        self.w = weights
        self._launches.clear()
        self._tokens = None  # the token-major launches hold the previous weights
        self._input_quant.clear()  # and the input quantizers the previous global scale
        self._glue.clear()  # the masked quantizers and activations too

    # --- token-major decode batches (`Nvfp4DequantExperts.small_batch_format`) -----------------

    def _apply_tokens(self, inp: StandardInput, out: torch.Tensor | None = None) -> StandardOutput:
        """The decode kernels of `moehal.kernels.triton_token_moe` on the block values: the
        input's rows quantized to NVFP4 by a launch before them, the activation rows as GEMM1's
        kernel writes them (`act_nvfp4_scale`), each GEMM's global scales in its epilogue.
        Three launches, no permute and no gather. (Quantized inside GEMM1's K loop instead, the
        input cost GEMM1 11 us more than the launch costs: session 51, call 2.)"""
        c = self.config
        x = inp.hidden if inp.hidden.stride(-1) == 1 else inp.hidden.contiguous()  # the quantizer's rows
        t = x.shape[0]
        if out is None:
            out = torch.empty(t, c.hidden_size, dtype=c.dtype, device=x.device)
        if t == 0:
            return StandardOutput(out, scaled=True)
        tokens = self._tokens if self._tokens is not None else self._bind_tokens()
        plan = self._input_quant.get((t, x.device))
        if plan is None:  # once per token count (host time of an eager step)
            plan = self._input_quant[(t, x.device)] = self._bind_input_quant(x)
        quantize, xq = plan
        quantize(x, xq)
        wts = inp.topk_weights if inp.topk_weights.is_contiguous() else inp.topk_weights.contiguous()
        return StandardOutput(tokens(xq, inp.topk_ids, wts, out), scaled=True)

    def _bind_input_quant(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The input quantizer's launch for x's token count and the rows it writes (process-wide
        scratch, `triton_permute.scratch`)."""
        from moehal.kernels.triton_permute import scratch
        from moehal_cuda.triton_glue import bind_nvfp4_qdq_rows

        w, c, t = self.w, self.config, x.shape[0]
        assert isinstance(w, DequantNvfp4Weights) and w.a13_global_scale is not None
        xq = scratch("nvfp4.token.x", (t, c.hidden_size), c.dtype, x.device)
        return bind_nvfp4_qdq_rows(x, w.a13_global_scale, self._input_rows(t, x.device)), xq

    def _bind_tokens(self, **extra: Any) -> Any:
        w = self.w
        assert isinstance(w, DequantNvfp4Weights) and w.a2_global_scale is not None
        return super()._bind_tokens(
            w13_out_scale=w.w13_out_scale, w2_out_scale=w.w2_out_scale, act_nvfp4_scale=w.a2_global_scale, **extra
        )

    def _input_rows(self, rows: int, device: torch.device) -> Any:
        """The input's token-major rows in `nvfp4_qdq_rows`'s contiguous mode, every row live:
        one segment of "expert 0" without a row bound (made once per bound token count)."""
        from moehal_cuda.triton_glue import RowIndex

        e = max(self.config.num_local_experts, 1)
        return RowIndex(
            rows,
            0,
            row_expert=torch.zeros(rows, dtype=torch.int32, device=device),  # every row: "expert 0"
            segment_start=torch.zeros(e, dtype=torch.int32, device=device),
            counts=torch.full((e,), 2**30, dtype=torch.int32, device=device),  # no bound
        )

    def tile_configs(self, rows: int) -> tuple[TileConfig | None, TileConfig | None]:
        """GEMM1's and GEMM2's tiles for a batch of at most `rows` routed rows: the table's
        measured Triton tiles at the nearest token count, else None (untuned). Kept per row
        count (the last `TILE_MEMO` counts): contiguous batches look them up on every call."""
        if self.tiles is None or not self.tuned_tiles:
            return None, None
        kept = self._tile_memo.pop(rows, None)
        if kept is None:
            kept = self._lookup_tiles(rows)
            if len(self._tile_memo) >= TILE_MEMO:
                del self._tile_memo[next(iter(self._tile_memo))]  # the least recently used
        self._tile_memo[rows] = kept
        return kept

    def _lookup_tiles(self, rows: int) -> tuple[TileConfig | None, TileConfig | None]:
        c = self.config
        assert self.tiles is not None
        tokens = max(1, -(-rows // c.top_k))
        e = c.num_local_experts
        return (
            self.tiles.triton_tile(e, c.w13_rows, c.hidden_size, "bf16", tokens),
            self.tiles.triton_tile(e, c.hidden_size, c.intermediate_size, "bf16", tokens),
        )

    def apply(self, inp: Any) -> Any:
        from moehal.kernels.triton_permute import contiguous_workspace
        from moehal_cuda.triton_glue import RowIndex, activation, nvfp4_qdq_rows

        w = self.w
        assert isinstance(w, DequantNvfp4Weights) and w.a13_global_scale is not None
        if isinstance(inp, StandardInput):
            return self._apply_tokens(inp)
        if inp.hidden.numel() == 0:
            return self._empty_output(inp)
        c = self.config
        # biases go into the GEMMs' epilogues: x @ w^T x scale + b, rounded once, as the reference
        if isinstance(inp, MaskedInput):
            quantize, act, (xq, hb, ab, yb) = self._masked_glue(inp)
            mm = inp.masked_m
            quantize(inp.hidden, xq, mm)
            g1, g2 = self._masked_launches(inp, xq, ab.hidden, hb.hidden, yb.hidden)
            if g1 is not None:
                g1(xq, None, hb.hidden, mm)
            act(mm)
            if g2 is not None:
                g2(ab.hidden, None, yb.hidden, mm)
            return MaskedOutput(yb.hidden)
        if not isinstance(inp, ContiguousInput):
            raise TypeError(f"NVFP4-dequant experts cannot take {type(inp).__name__}")
        from moehal.kernels.triton_grouped_gemm import contiguous_grouped_gemm

        tag = f"{c.w13_rows}:{c.intermediate_size}:{c.hidden_size}"
        lead = (inp.hidden.shape[0],)
        rows = RowIndex(lead[0], 0, row_expert=inp.row_expert, segment_start=inp.segment_start, counts=inp.counts)
        # as the GEMM buffers: this call's rows of one buffer (`DeepGemmExpertsRunner._buffers`)
        cap = self.contiguous_capacity(lead[0])
        xq = contiguous_workspace(f"dgq.x:{tag}", lead[0], cap, inp.hidden.shape[1], c.dtype, inp.hidden.device, False)
        xq = xq.hidden
        nvfp4_qdq_rows(inp.hidden, xq, w.a13_global_scale, rows)
        hb, ab, yb = self._buffers(lead, inp.hidden.device)
        t1, t2 = self.tile_configs(lead[0])
        align = self.fmt.row_alignment
        contiguous_grouped_gemm(xq, w.w13, hb.hidden, inp.row_expert, align, w.w13_out_scale, t1, w.w13_bias)
        activation(hb.hidden, ab, yb.hidden, rows, c, None, False, w.a2_global_scale)
        contiguous_grouped_gemm(ab.hidden, w.w2, yb.hidden, inp.row_expert, align, w.w2_out_scale, t2, w.w2_bias)
        return ContiguousOutput(yb.hidden)

    def _masked_glue(self, inp: MaskedInput) -> tuple[Any, Any, tuple[torch.Tensor, Any, Any, Any]]:
        """The masked batch's input quantizer and activation launches, bound once per (row
        bound, E, max_m) and kept until the next `load` (they hold the global scales), and the
        workspaces they write (process-wide per shape, `workspace`): the GEMM input rows, then
        GEMM1's output, the activation and GEMM2's output (`DeepGemmExpertsRunner._buffers`).
        Host time of an eager step: binding both per call cost a 16-128 token step about as
        much as the rest of its experts (session 52)."""
        e, m, h = inp.hidden.shape
        key = (inp.total_rows_bound, e, m)
        kept = self._glue.get(key)
        if kept is not None:
            return kept
        from moehal.kernels.triton_permute import workspace
        from moehal_cuda.triton_glue import RowIndex, bind_activation, bind_nvfp4_qdq_rows

        w, c, dev = self.w, self.config, inp.hidden.device
        assert isinstance(w, DequantNvfp4Weights) and w.a13_global_scale is not None
        check_masked_rows(m)
        tag = f"{c.w13_rows}:{c.intermediate_size}:{c.hidden_size}"
        xq = workspace(f"dgq.x:{tag}", (e, m), h, c.dtype, dev, False).hidden
        hb, ab, yb = bufs = self._buffers((e, m), dev)
        rows = RowIndex(e * m, m, masked_m=inp.masked_m, total_rows=inp.total_rows_bound)
        quantize = bind_nvfp4_qdq_rows(inp.hidden, w.a13_global_scale, rows)
        act = bind_activation(hb.hidden, ab, yb.hidden, rows, c, None, False, w.a2_global_scale)
        kept = (quantize, act, (xq, *bufs))
        if self.keep_masked_glue:
            self._glue[key] = kept
        return kept

    def _masked_launches(
        self, inp: MaskedInput, x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, y: torch.Tensor
    ) -> tuple[Any, Any]:
        """GEMM1's and GEMM2's launches for this batch's row bound (None: nothing to compute),
        bound on first sight and kept while they take these buffers and weights."""
        from moehal.kernels.triton_grouped_gemm import bind_masked_grouped_gemm

        w = self.w
        assert isinstance(w, DequantNvfp4Weights)
        bound = inp.total_rows_bound
        kept = self._launches.get(bound)
        if kept is not None and all(
            g is None or g.takes(*args) for g, args in zip(kept, ((x, None, w.w13, h), (a, None, w.w2, y)))
        ):
            return kept
        t1, t2 = self.tile_configs(bound)
        g1 = bind_masked_grouped_gemm(x, None, w.w13, None, h, bound, t1, w.w13_out_scale, w.w13_bias)
        g2 = bind_masked_grouped_gemm(a, None, w.w2, None, y, bound, t2, w.w2_out_scale, w.w2_bias)
        self._launches[bound] = (g1, g2)
        return g1, g2


class Nvfp4DequantExperts(DeepGemmExperts):
    """NVFP4 on SM90: BF16 grouped GEMMs on weights unpacked at load, the global scales in the
    GEMMs' fp32 epilogues; activations quantized to NVFP4 in the glue so the numerics follow the
    scheme. The name is the component's id since session 13: it takes DeepGEMM's layouts and
    buffers, since session 49 Triton's GEMMs, and since session 50 needs no DeepGEMM (module
    docstring)."""

    name = "deepgemm_nvfp4_dequant"
    priority = 15  # below native FP4 kernels (CuteDSL on SM100)
    description = (
        "NVFP4 weights unpacked to BF16 once + BF16 Triton grouped GEMMs with the global scales in their "
        "epilogues; NVFP4 activation quantization in the glue"
    )
    quant_schemes = frozenset({NVFP4})
    weight_layout: ClassVar[str] = LAYOUT
    # Decode batches on the token-major kernels, by the bf16 layers' rule (None: `small_batch_tokens`;
    # 0: never, the masked path). Session 50 (H200) measured that path no faster (54.7 us at one
    # token of Qwen3-30B-A3B, masked 53.3, bf16 25.9): the NVFP4 quantizer's programs walked a
    # row's 128-column chunks in series. Session 51 split the chunks (16.5 -> 3.7 us per launch)
    # and has GEMM1's decode kernel write the activation quantized (`token_gemm_act`'s
    # `act_nvfp4_scale`): three launches, 32.8 us against the masked path's 39.7 (docs/backends/cuda.md).
    small_batch_max_tokens: ClassVar[int | None] = None

    def check_hardware(self, req: BuildRequest) -> Decision:
        # SM90 is where these run (SM100 has FP4 tensor cores and CuteDSL); no DeepGEMM device pin
        return sm_decision(req, SUPPORTED_SM, "NVFP4-on-Hopper dequant")

    def check_libraries(self, req: BuildRequest) -> Decision:
        return triton_decision()

    def _alignment(self) -> int:
        return CONTIGUOUS_ROW_ALIGNMENT

    def small_batch_format(self, req: BuildRequest) -> SmallBatchFormat | None:
        """Decode batches may take token-major input, as bf16 layers do: the decode kernels on
        the bf16 block values (`Nvfp4DequantRunner._apply_tokens`), up to `small_batch_max_tokens`
        tokens (None, the default: `small_batch_tokens` of the bf16 weights' size per token; 0:
        never)."""
        c = req.config
        per_token = c.top_k * (c.w13_rows + c.intermediate_size) * c.hidden_size * 2  # bf16 block values
        n = self.small_batch_max_tokens
        if n is None:
            n = small_batch_tokens(c.num_local_experts, c.top_k, per_token)
        if n == 0:
            return None
        fmt = ActivationFormat(Layout.STANDARD, c.dtype)
        return SmallBatchFormat(fmt, n, "token-major decode kernels on the block values: no permute, no gather")

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
        """None: conformance's small shapes run the same code as any size (the GEMMs' tiles come
        from a table, but every tile computes the same; decode batches take the token-major
        kernels at conformance's sizes too)."""
        return ()

    def input_formats(self, req: BuildRequest) -> list[Any]:
        masked = ActivationFormat(Layout.MASKED, req.config.dtype, row_alignment=MASKED_ROW_ALIGNMENT)
        contig = ActivationFormat(Layout.CONTIGUOUS, req.config.dtype, row_alignment=self._alignment())
        mt = req.config.max_tokens
        return [masked, contig] if mt is not None and mt <= 512 else [contig, masked]

    def build(self, req: BuildRequest, fmt: Any) -> ExpertsRunner:
        tiles = GemmChooser(req.hardware.name) if req.hardware.kind == "cuda" else None
        return Nvfp4DequantRunner(req, fmt, None, tiles)
