# ruff: noqa: ANN001, ANN201, ANN202  (Triton JIT kernels: arguments are untyped by design)
"""Triton glue between the two grouped GEMMs: bias + activation + optional 1x128 FP8
quantization in one pass over the GEMM1 output, and the GEMM2 bias.

Rows are addressed in either layout:
- masked `[E, max_m, N]`: row r = e*max_m + m is live iff m < masked_m[e];
- contiguous `[M, N]`: row r is live iff row_expert[r] >= 0 and
  r - segment_start[row_expert[r]] < counts[row_expert[r]].

Dead rows are never computed: masked grids walk a tile table of the live rows built on the
device from masked_m (`masked_row_tile`), sized by the host's bound on the routed rows, so a
decode step does not launch a program per row block of the worst-case buffer. Rows that were
live in the previous call on the same buffers and are dead now are zeroed in the activation
buffer and in the GEMM2 output buffer (masked: per-expert row counts, `zero_stale_rows`;
contiguous: a per-row bitmap), so padding rows are exactly zero after GEMM2 without clearing
the whole (worst-case sized) buffers on every call: padding rows inside a GEMM tile compute
0 @ W = 0, and only live rows get biases.

Numerics follow `moehal.reference.math.expert_mlp`: GEMM1 output (+ bias) rounded to the layer
dtype, activation in float32 rounded to the layer dtype, then quantized for GEMM2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from moehal.config import Activation, MoEConfig
from moehal.kernels.host import cdiv, kernel_modules_interpreted, next_power_of_2
from moehal.kernels.launch import Site, fast_launch, site
from moehal.kernels.triton_grouped_gemm import num_m_tiles
from moehal.kernels.triton_nvfp4 import nvfp4_qdq
from moehal.kernels.triton_permute import (
    QUANT_GROUP,
    PaddedBuffer,
    e4m3_groups_quant,
    e4m3_static_quant,
    masked_row_tile,
    publish_rows,
    round_to_bf16_grid,
    stale_splits,
    zero_stale_rows,
)

INTERPRETED = kernel_modules_interpreted()  # as triton.jit decorates this module's kernels (host.py)

ACT_IDS = {Activation.SILU: 0, Activation.GELU: 1, Activation.SWIGLU_OAI: 2}

# The NVFP4 quantizer (`nvfp4_qdq_rows`) gives each 128-column chunk of a row tile a program of
# its own. False: one program walks the row's chunks in series (the code before session 51,
# kept for tools/bench_ab.py's `serial-qdq` A/B).
QDQ_SPLIT_COLUMNS = True


@triton.jit
def _program_rows(
    pid,
    num_rows,
    masked_m_ptr,
    row_expert_ptr,
    seg_start_ptr,
    counts_ptr,
    MASKED: tl.constexpr,
    E: tl.constexpr,
    E_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The rows of program `pid`: (expert, expert address, row address, live, in range).
    Masked: tile `pid` of the live rows' tile table. Contiguous: rows [pid*BLOCK_R, +BLOCK_R)."""
    if MASKED:
        e, m, live = masked_row_tile(pid, masked_m_ptr, E, E_P, BLOCK_R)
        ev = tl.zeros_like(m) + tl.minimum(e, E - 1)
        return ev, ev, m, live, live
    else:
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rin = r < num_rows
        e = tl.load(row_expert_ptr + r, mask=rin, other=-1)
        has = rin & (e >= 0)
        ec = tl.where(has, e, 0)
        start = tl.load(seg_start_ptr + ec, mask=has, other=0)
        cnt = tl.load(counts_ptr + ec, mask=has, other=0)
        live = has & (r - start < cnt)
        return ec, tl.zeros_like(r), r, live, rin


@fast_launch
@triton.jit
def _qdq_rows(
    x_ptr,
    s_xe,
    s_xm,
    o_ptr,
    s_oe,
    s_om,
    gs_ptr,
    masked_m_ptr,
    row_expert_ptr,
    seg_start_ptr,
    counts_ptr,
    num_rows,
    H,
    MASKED: tl.constexpr,
    E: tl.constexpr,
    E_P: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    SPLIT_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    e, e_addr, m, live, _ = _program_rows(
        tl.program_id(0), num_rows, masked_m_ptr, row_expert_ptr, seg_start_ptr, counts_ptr, MASKED, E, E_P, BLOCK_R
    )
    if tl.max(live.to(tl.int32), axis=0) > 0:
        gs = tl.load(gs_ptr).to(tl.float32)
        e64 = e_addr[:, None].to(tl.int64)
        m64 = m[:, None].to(tl.int64)
        # SPLIT_H: one BLOCK_H-column chunk per program (grid axis 1); else one program walks
        # the row's chunks in series, one memory round trip per chunk (`QDQ_SPLIT_COLUMNS`)
        lo = tl.program_id(1) * BLOCK_H if SPLIT_H else 0
        hi = lo + BLOCK_H if SPLIT_H else H
        for c0 in range(lo, hi, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            mk = live[:, None] & (cols[None, :] < H)
            v = tl.load(x_ptr + e64 * s_xe + m64 * s_xm + cols[None, :], mask=mk, other=0.0).to(tl.float32)
            v = nvfp4_qdq(v, gs, BLOCK_R, BLOCK_H, EXACT_ROUND)  # exact in bf16: no rounding
            tl.store(o_ptr + e64 * s_oe + m64 * s_om + cols[None, :], v.to(o_ptr.dtype.element_ty), mask=mk)


@fast_launch
@triton.jit
def _act_rows(
    h_ptr,
    s_he,
    s_hm,
    out_ptr,
    s_oe,
    s_om,
    sc_ptr,
    s_se,
    s_sm,
    s_sg,
    y_ptr,
    s_ye,
    s_ym,
    b_ptr,
    s_be,
    masked_m_ptr,
    row_expert_ptr,
    seg_start_ptr,
    counts_ptr,
    written_ptr,
    state_ptr,
    num_rows,
    n_tiles,
    I_SIZE,
    H,
    alpha,
    limit,
    gs_ptr,
    static_ptr,
    n_chunks,
    I_SPAN,
    H_SPAN,
    MASKED: tl.constexpr,
    E: tl.constexpr,
    E_P: tl.constexpr,
    N_SPLIT: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,
    UE8M0: tl.constexpr,
    STATIC: tl.constexpr,
    NVFP4: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # program = (row tile, column chunk): chunk c owns columns [c*I_SPAN, (c+1)*I_SPAN) of the
    # output and [c*H_SPAN, (c+1)*H_SPAN) of y, so no program reads what another writes.
    # Masked grids append E x N_SPLIT programs that zero stale rows over all columns.
    pid = tl.program_id(0)
    if STATIC:  # fp8_tensor: GEMM2's static input scale, loaded once per program
        sc1 = tl.load(static_ptr)
    if pid >= n_tiles * n_chunks:
        if MASKED:
            sp = pid - n_tiles * n_chunks
            ex = sp // N_SPLIT
            cnt = tl.load(masked_m_ptr + ex)
            before = tl.load(state_ptr + ex)
            e_off = ex.to(tl.int64)
            part = sp % N_SPLIT
            zero_stale_rows(out_ptr + e_off * s_oe, s_om, 0, I_SIZE, cnt, before, part, N_SPLIT, BLOCK_R, BLOCK_I)
            zero_stale_rows(y_ptr + e_off * s_ye, s_ym, 0, H, cnt, before, part, N_SPLIT, BLOCK_R, BLOCK_H)
            publish_rows(state_ptr, ex, cnt, E, N_SPLIT)
        return
    chunk = pid % n_chunks
    pid = pid // n_chunks
    i_lo = chunk * I_SPAN
    i_hi = tl.minimum(i_lo + I_SPAN, I_SIZE)
    h_lo = chunk * H_SPAN
    h_hi = tl.minimum(h_lo + H_SPAN, H)
    e, e_addr, m, live, rin = _program_rows(
        pid, num_rows, masked_m_ptr, row_expert_ptr, seg_start_ptr, counts_ptr, MASKED, E, E_P, BLOCK_R
    )
    e64 = e_addr.to(tl.int64)
    m64 = m.to(tl.int64)
    if not MASKED:  # contiguous: per-row bitmap, one cell per (row, column chunk)
        # Stale rows are zeroed before the live rows are computed: placed after that loop, the
        # zeroing stores had no effect in the static-scale (fp8_tensor) kernel that Triton 3.6
        # compiled for an H100, and rows of the previous call survived as padding
        # (docs/device-runs/2026-11-24-session21; tools/contiguous_padding_probe.py).
        bit = written_ptr + m64 * n_chunks + chunk
        stale = rin & (tl.load(bit, mask=rin, other=0) != 0) & (~live)
        if tl.max(stale.to(tl.int32), axis=0) > 0:
            orow = out_ptr + m64[:, None] * s_om
            for c0 in range(i_lo, i_hi, BLOCK_I):
                cols = c0 + tl.arange(0, BLOCK_I)
                tl.store(
                    orow + cols[None, :],
                    tl.zeros((BLOCK_R, BLOCK_I), dtype=out_ptr.dtype.element_ty),
                    mask=stale[:, None] & (cols[None, :] < i_hi),
                )
            yrow = y_ptr + m64[:, None] * s_ym
            for c0 in range(h_lo, h_hi, BLOCK_H):
                cols = c0 + tl.arange(0, BLOCK_H)
                tl.store(
                    yrow + cols[None, :],
                    tl.zeros((BLOCK_R, BLOCK_H), dtype=y_ptr.dtype.element_ty),
                    mask=stale[:, None] & (cols[None, :] < h_hi),
                )
        tl.store(bit, live.to(tl.int8), mask=rin)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        hrow = h_ptr + e64[:, None] * s_he + m64[:, None] * s_hm
        orow = out_ptr + e64[:, None] * s_oe + m64[:, None] * s_om
        for c0 in range(i_lo, i_hi, BLOCK_I):
            cols = c0 + tl.arange(0, BLOCK_I)
            cm = cols < i_hi
            mk = live[:, None] & cm[None, :]
            g = tl.load(hrow + cols[None, :], mask=mk, other=0.0)
            if HAS_BIAS:
                brow = b_ptr + e[:, None].to(tl.int64) * s_be
                g = g.to(tl.float32) + tl.load(brow + cols[None, :], mask=mk, other=0.0).to(tl.float32)
                if EXACT_ROUND:
                    g = round_to_bf16_grid(g)
            g = g.to(h_ptr.dtype.element_ty).to(tl.float32)
            if GATED:
                u = tl.load(hrow + I_SIZE + cols[None, :], mask=mk, other=0.0)
                if HAS_BIAS:
                    bu = tl.load(brow + I_SIZE + cols[None, :], mask=mk, other=0.0).to(tl.float32)
                    u = u.to(tl.float32) + bu
                    if EXACT_ROUND:
                        u = round_to_bf16_grid(u)
                    u = u.to(h_ptr.dtype.element_ty)
                u = u.to(tl.float32)
            if ACT == 0:
                a = g * tl.sigmoid(g)
            elif ACT == 1:
                a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
            else:
                g = tl.minimum(g, limit)
                u = tl.minimum(tl.maximum(u, -limit), limit)
                a = g * tl.sigmoid(alpha * g)
                u = u + 1.0
            if GATED:
                a = a * u
            if EXACT_ROUND:
                a = round_to_bf16_grid(a)
            a = a.to(h_ptr.dtype.element_ty).to(tl.float32)  # the layer dtype, as the reference rounds
            if NVFP4:  # weight-dequant path: GEMM2's input as NVFP4 codes x block scales
                a = nvfp4_qdq(a, tl.load(gs_ptr).to(tl.float32), BLOCK_R, BLOCK_I, EXACT_ROUND)
            if QUANT:  # BLOCK_I // 128 groups of 1x128 per step
                if STATIC:  # the static scale, written to every group's slot
                    q = e4m3_static_quant(tl.where(mk, a, 0.0), sc1, EXACT_ROUND)
                    sc = tl.zeros((BLOCK_R, BLOCK_I // 128), dtype=tl.float32) + sc1
                else:
                    q, sc = e4m3_groups_quant(tl.where(mk, a, 0.0), BLOCK_R, BLOCK_I // 128, UE8M0, EXACT_ROUND)
                tl.store(orow + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mk)
                grp = c0 // 128 + tl.arange(0, BLOCK_I // 128)
                srow = sc_ptr + e64 * s_se + m64 * s_sm
                tl.store(srow[:, None] + grp[None, :] * s_sg, sc, mask=live[:, None] & (grp * 128 < i_hi)[None, :])
            else:
                tl.store(orow + cols[None, :], a.to(out_ptr.dtype.element_ty), mask=mk)


@fast_launch
@triton.jit
def _bias_rows(
    y_ptr,
    s_ye,
    s_ym,
    b_ptr,
    s_be,
    masked_m_ptr,
    row_expert_ptr,
    seg_start_ptr,
    counts_ptr,
    num_rows,
    H,
    MASKED: tl.constexpr,
    E: tl.constexpr,
    E_P: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    e, e_addr, m, live, _ = _program_rows(
        tl.program_id(0), num_rows, masked_m_ptr, row_expert_ptr, seg_start_ptr, counts_ptr, MASKED, E, E_P, BLOCK_R
    )
    if tl.max(live.to(tl.int32), axis=0) > 0:
        yrow = y_ptr + e_addr[:, None].to(tl.int64) * s_ye + m[:, None].to(tl.int64) * s_ym
        brow = b_ptr + e[:, None].to(tl.int64) * s_be
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            mk = live[:, None] & (cols[None, :] < H)
            v = tl.load(yrow + cols[None, :], mask=mk, other=0.0).to(tl.float32)
            v += tl.load(brow + cols[None, :], mask=mk, other=0.0).to(tl.float32)
            if EXACT_ROUND:
                v = round_to_bf16_grid(v)
            tl.store(yrow + cols[None, :], v.to(y_ptr.dtype.element_ty), mask=mk)


# --- host side ------------------------------------------------------------------------------


class RowIndex:
    """Which rows are live: masked (`masked_m`) or contiguous (`row_expert`, `segment_start`,
    `counts`). Built from a MaskedInput / ContiguousInput without reading anything back.

    total_rows (masked): a host-side bound on sum(masked_m) (`MaskedInput.total_rows_bound`);
    it sizes the grids, so a decode step's kernels launch programs for its routed rows only.
    """

    def __init__(
        self,
        num_rows: int,
        max_m: int,
        masked_m: torch.Tensor | None = None,
        row_expert: torch.Tensor | None = None,
        segment_start: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        total_rows: int | None = None,
    ) -> None:
        self.num_rows, self.max_m, self.masked = num_rows, max_m, masked_m is not None
        any_t = masked_m if masked_m is not None else row_expert
        assert any_t is not None
        self.masked_m = masked_m if masked_m is not None else any_t
        self.row_expert = row_expert if row_expert is not None else any_t
        self.segment_start = segment_start if segment_start is not None else any_t
        self.counts = counts if counts is not None else any_t
        self.num_experts = masked_m.shape[0] if masked_m is not None else 1
        self.total_rows = num_rows if total_rows is None else min(int(total_rows), num_rows)

    def tiles(self, block_r: int) -> int:
        """Programs that cover every live row in blocks of block_r (see `_program_rows`)."""
        if self.masked:
            return num_m_tiles(self.total_rows, self.num_experts, block_r)
        return cdiv(self.num_rows, block_r)

    def expert_consts(self) -> dict[str, int]:
        e = self.num_experts
        return {"E": e, "E_P": max(16, next_power_of_2(e))}


def _strides2(t: torch.Tensor, masked: bool) -> tuple[int, int]:
    return (t.stride(0), t.stride(1)) if masked else (0, t.stride(0))


# Column span of one activation program: wide layers (Mixtral: I = 14336) get many programs
# per row block instead of one program walking every column (150 us -> a few at 16 tokens).
ACT_COL_SPAN = 512


@dataclass(frozen=True)
class ActTile:
    block_r: int  # rows per program
    col_span: int  # output columns per program (a multiple of the kernel's column block)
    num_warps: int = 4
    # column blocks per load (a power of two); quantizing activations quantize this many
    # 1x128 groups at a time
    blocks_per_load: int = 1


def act_tile(rows: RowIndex, block_i: int) -> ActTile:
    """The activation kernel's tile for this batch. Contiguous buffers keep a written-rows
    bitmap with one cell per `ACT_COL_SPAN` columns, so their span is fixed; masked buffers
    keep none, so the split may follow the batch: few row tiles (decode) get one column block
    per program, a single round of memory latency."""
    if rows.masked and rows.tiles(16) < 64:
        return ActTile(16, block_i)
    return ActTile(16, ACT_COL_SPAN)


def activation_chunks(intermediate_size: int) -> int:
    """Column chunks of the activation grid; its written-rows bitmap has this many cells per row."""
    return cdiv(intermediate_size, ACT_COL_SPAN)


def activation(
    h: torch.Tensor,
    out: PaddedBuffer,
    y: torch.Tensor,
    rows: RowIndex,
    config: MoEConfig,
    bias: torch.Tensor | None = None,
    ue8m0: bool = False,
    nvfp4_global_scale: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
) -> None:
    """GEMM1 output `h [.., N13]` -> `out.hidden [.., I]` (+ `out.scales` when FP8: 1x128 groups'
    scales, or `static_scale` in every group's slot), in place;
    zeroes rows of `out` and `y` that went stale since the previous call on `out`. Layout per
    `rows` (masked: 3-D tensors). `out` comes from `workspace(..., bitmap_cols=activation_chunks(I))`
    and must be the only activation buffer used with `y` (its record covers y's rows too).
    (`bind_activation` decides the launch; this binds and calls in one go.)"""
    bind_activation(h, out, y, rows, config, bias, ue8m0, nvfp4_global_scale, static_scale)(
        rows.masked_m, rows.row_expert, rows.segment_start, rows.counts
    )


def bind_activation(
    h: torch.Tensor,
    out: PaddedBuffer,
    y: torch.Tensor,
    rows: RowIndex,
    config: MoEConfig,
    bias: torch.Tensor | None = None,
    ue8m0: bool = False,
    nvfp4_global_scale: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
) -> ActivationLaunch:
    """`activation`'s launch on these buffers, weights and row bounds: every argument but the
    row index's tensors decided once, to call as `launch(masked_m)` (masked) or
    `launch(row_expert=, segment_start=, counts=)` (contiguous) for batches of the same bound
    on the same buffers. An eager decode step keeps one per batch bound (host time)."""
    i_size, h_size = config.intermediate_size, y.shape[-1]
    m = rows.masked
    if m:
        if out.expert_rows is None or out.expert_rows.shape[1] != rows.num_experts:
            raise ValueError(f"masked activation buffer needs per-expert row counts for {rows.num_experts} experts")
        state = out.expert_rows
    else:
        n_chunks = activation_chunks(i_size)
        if out.written.numel() != rows.num_rows * n_chunks:
            raise ValueError(
                f"activation bitmap has {out.written.numel()} cells; "
                f"{rows.num_rows} rows x {n_chunks} column chunks needed"
            )
        state = out.written
    quant = out.scales is not None
    if static_scale is not None and (not quant or ue8m0 or static_scale.numel() != 1):
        raise ValueError("static_scale quantizes into an fp8 buffer with fp32 group scales, one scale value")
    s_he, s_hm = _strides2(h, m)
    s_oe, s_om = _strides2(out.hidden, m)
    s_ye, s_ym = _strides2(y, m)
    if quant:
        out_scales = out.scales
        assert out_scales is not None
        s_se, s_sm = _strides2(out_scales, m)
        s_sg = out_scales.stride(-1)
        block_i = QUANT_GROUP
    else:
        out_scales = out.hidden
        s_se = s_sm = s_sg = 0
        block_i = min(128, next_power_of_2(i_size))
    tile = act_tile(rows, block_i)
    block_r, col_span = tile.block_r, tile.col_span
    if tile.blocks_per_load & (tile.blocks_per_load - 1) or col_span % block_i:
        raise ValueError(f"activation tile {tile}: loads of a power of two of {block_i}-column blocks")
    block_i *= tile.blocks_per_load
    block_h = min(256, next_power_of_2(h_size))
    n_tiles = rows.tiles(block_r)
    if m:
        n_chunks = cdiv(i_size, col_span)
    elif col_span != ACT_COL_SPAN:
        raise ValueError(f"contiguous activation spans {ACT_COL_SPAN} columns (its bitmap's cells), not {col_span}")
    n_split = stale_splits(rows.max_m, block_r, rows.num_experts) if m else 1
    stale_programs = rows.num_experts * n_split if m else 0
    b = bias if bias is not None else h
    return ActivationLaunch(
        (n_tiles * n_chunks + stale_programs,),
        (h, s_he, s_hm, out.hidden, s_oe, s_om, out_scales, s_se, s_sm, s_sg, y, s_ye, s_ym, b,
         b.stride(0) if bias is not None else 0),
        (out.written if not m else state, state, rows.num_rows, n_tiles, i_size, h_size,
         float(config.swiglu_alpha), float(config.swiglu_limit),
         nvfp4_global_scale if nvfp4_global_scale is not None else h,
         static_scale if static_scale is not None else h, n_chunks, col_span,
         cdiv(cdiv(h_size, n_chunks), block_h) * block_h),
        dict(
            MASKED=m, **rows.expert_consts(), N_SPLIT=n_split, GATED=config.gated,
            ACT=ACT_IDS[config.activation], HAS_BIAS=bias is not None, QUANT=quant, UE8M0=ue8m0,
            STATIC=static_scale is not None, NVFP4=nvfp4_global_scale is not None, EXACT_ROUND=INTERPRETED,
            BLOCK_R=block_r, BLOCK_I=block_i,
            BLOCK_H=block_h, num_warps=tile.num_warps,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class ActivationLaunch:
    """`_act_rows`'s launch on one set of buffers, weights and row bounds (`bind_activation`):
    the buffers, their strides and the grid are bound; a call passes the row index's tensors."""

    grid: tuple[int]
    head: tuple  # h, out, scales, y, bias and their strides
    tail: tuple  # row records, sizes, the activation's constants, column chunks
    kw: dict

    def __call__(
        self,
        masked_m: torch.Tensor | None = None,
        row_expert: torch.Tensor | None = None,
        segment_start: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> None:
        """Masked: `masked_m` int32 `[E]`. Contiguous: `row_expert`, `segment_start`, `counts`.
        (A layout's unused tensors may be any of the given ones, as in `RowIndex`.)"""
        any_t = masked_m if masked_m is not None else row_expert
        assert any_t is not None
        self._site(
            *self.head,
            any_t if masked_m is None else masked_m,
            any_t if row_expert is None else row_expert,
            any_t if segment_start is None else segment_start,
            any_t if counts is None else counts,
            *self.tail,
        )

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_act_rows, self.grid, **self.kw)


def add_bias(y: torch.Tensor, bias: torch.Tensor, rows: RowIndex) -> None:
    """y[live rows] += bias[expert of row], in place (rounded to y's dtype)."""
    m = rows.masked
    s_ye, s_ym = _strides2(y, m)
    block_r = 16
    _bias_rows[(rows.tiles(block_r),)](
        y,
        s_ye,
        s_ym,
        bias,
        bias.stride(0),
        rows.masked_m,
        rows.row_expert,
        rows.segment_start,
        rows.counts,
        rows.num_rows,
        y.shape[-1],
        MASKED=m,
        **rows.expert_consts(),
        EXACT_ROUND=INTERPRETED,
        BLOCK_R=block_r,
        BLOCK_H=min(256, next_power_of_2(y.shape[-1])),
    )


def nvfp4_qdq_rows(x: torch.Tensor, out: torch.Tensor, global_scale: torch.Tensor, rows: RowIndex) -> None:
    """out[live rows] = x[live rows] quantized to NVFP4 with `global_scale` (fp32 `[]`, read on
    the device), as its codes times their block scales: the quantize-dequantize times the global
    scale, exact in bf16 (`nvfp4_qdq`). (`bind_nvfp4_qdq_rows` binds it once for repeated calls.)"""
    bind_nvfp4_qdq_rows(x, global_scale, rows)(x, out)


def bind_nvfp4_qdq_rows(x: torch.Tensor, global_scale: torch.Tensor, rows: RowIndex) -> QdqLaunch:
    """`nvfp4_qdq_rows`'s launch for inputs of x's shape and strides, this scale and these rows,
    to call as `launch(x, out)`: the decode steps' input quantization, a pinned launch (host
    time of an eager step, `moehal.kernels.launch.Site`)."""
    m = rows.masked
    block_r, block_h = 16, min(128, next_power_of_2(x.shape[-1]))
    split = QDQ_SPLIT_COLUMNS
    return QdqLaunch(
        (rows.tiles(block_r), cdiv(x.shape[-1], block_h) if split else 1),
        m,
        (global_scale, rows.masked_m, rows.row_expert, rows.segment_start, rows.counts, rows.num_rows, x.shape[-1]),
        dict(
            MASKED=m, **rows.expert_consts(), EXACT_ROUND=INTERPRETED, SPLIT_H=split, BLOCK_R=block_r,
            BLOCK_H=block_h,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class QdqLaunch:
    """`_qdq_rows`'s launch with its grid, scale, row index and constexprs bound."""

    grid: tuple[int, int]
    masked: bool
    tail: tuple  # the global scale, the row index's tensors, rows, columns
    kw: dict

    def __call__(self, x: torch.Tensor, out: torch.Tensor, masked_m: torch.Tensor | None = None) -> None:
        """masked_m: this batch's row counts (masked launches bound once per row bound and kept,
        `Nvfp4DequantRunner._masked_glue`); None: the tensors the launch was bound with."""
        tail = self.tail
        if masked_m is not None:  # a masked row index names masked_m in all four places (`RowIndex`)
            if not self.masked:
                raise ValueError("masked_m given to a contiguous row quantizer")
            tail = (tail[0], masked_m, masked_m, masked_m, masked_m, *tail[5:])
        self._site(x, *_strides2(x, self.masked), out, *_strides2(out, self.masked), *tail)

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_qdq_rows, self.grid, **self.kw)
