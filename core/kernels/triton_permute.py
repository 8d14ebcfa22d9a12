# ruff: noqa: ANN001, ANN201, ANN202  (Triton JIT kernels: arguments are untyped by design)
"""Sync-free token permutation in Triton: the masked and contiguous layouts and the weighted
combine, with optional fused 1x128 FP8 activation quantization on the way in.

Semantics follow `moehal.permute` exactly (slots are (token, k) pairs flattened token-major;
within an expert, slots keep their order; contiguous segments start at multiples of the
alignment; rows past an expert's count are padding) and are tested against it.

Three launches per dispatch/combine round trip (two for masked decode-sized batches), none of
which reads anything back to the host:

1. `_expert_positions`: program (local expert, chunk of slots) writes, for each of the
   expert's slots in its chunk, the slot's position among the expert's slots (stable), and
   the expert's count; batches of several chunks run `_expert_chunk_counts` first.
   Masked dispatches of at most FUSED_POSITIONS_MAX_SLOTS slots skip it: the scatter kernel's
   programs compare all slot ids themselves.
2. `_scatter_rows`: programs [0, n_slot_programs) copy (and quantize) each slot's token row
   to its destination row and record it in `slot_row` (quantizing prefill batches load and
   quantize each token row once for its top-k slots: `ScatterTile.token_rows`); the remaining
   programs walk the destination rows, write the contiguous layout's per-row expert ids /
   segment starts, and keep padding rows zero (see below).
3. `_combine_rows`: per token, sum over k of router weight x expert row, times the routed
   scaling factor, in float32, stored in the layer dtype.

Zero padding without clearing whole buffers: destination buffers are persistent (one per
shape, see `PaddedBuffer`) and remember which rows the previous call wrote. Each dispatch
zeroes only rows that held data then and are padding now, so the cost is proportional to the
routed rows, not to the worst-case buffer (E_local x max_m rows for masked):
- masked: an expert's live rows are always a prefix, so one count per expert is the whole
  record (`expert_rows`). E x N_SPLIT small programs zero rows [count now, count before) of
  their expert, and the last of them to finish records the new count (`zero_stale_rows`,
  `publish_rows`). A decode step thus launches a few hundred programs, not one per row
  block of the worst-case buffer (that was 5 us of a 56 us Qwen3-30B-A3B step on an H100).
- contiguous: a per-row "written" bitmap (the buffer is only as large as the routed rows).

Portable: no vendor-specific instruction; the FP8 dtype is the destination tensor's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from moehal.kernels.host import (
    cdiv,
    kernel_modules_interpreted,
    next_power_of_2,
    note_fetched,
    persistent_tensors,
)
from moehal.kernels.launch import Site, fast_launch, site
from moehal.kernels.triton_fused_moe import _bf16_grid, _ceil_pow2, _static_fp8

# The grouped layouts' row counts are plain integer math, kept Triton-free in moehal.permute (a
# plugin without Triton sizes its buffers with them); re-exported for this module's callers.
from moehal.permute import contiguous_rows as contiguous_rows
from moehal.permute import masked_rows as masked_rows
from moehal.permute import round_up

INTERPRETED = kernel_modules_interpreted()  # as triton.jit decorates this module's kernels (host.py)

QUANT_GROUP = 128
# Contiguous layouts mark padding rows -1 in `row_expert` (DeepGEMM's `m_indices` convention):
# DeepGEMM's SM90 FP8 grouped GEMM then skips each 64-row half of a 128-row tile whose first row
# is padding. False marks whole segments with their expert, as before session 32 (for A/Bs).
MARK_PADDING_ROWS = True


# --- kernels ----------------------------------------------------------------------------------


@triton.jit
def round_to_e4m3_grid(v):
    """Round float32 (already within +-448) to the nearest e4m3 value, ties to even.

    Only used under the Triton interpreter, whose float8 cast rounds wrongly at binade
    boundaries; on the GPU the hardware conversion does this."""
    a = tl.abs(v)
    e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    step = tl.exp2(tl.maximum(e, -6.0) - 3.0)
    x = a / step
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))
    return tl.where(v < 0, -r * step, r * step)


@triton.jit
def e4m3_scale(amax, UE8M0: tl.constexpr):
    """A 1x128 group's FP8 scale from its amax: amax / 448 (UE8M0: rounded up to a power of
    two). div_rn (IEEE, once per group): the reference's scale bit for bit on the GPU too."""
    sc = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)
    if UE8M0:
        sc = _ceil_pow2(sc)
    return sc


@triton.jit
def e4m3_scaled(v, sc, EXACT_ROUND: tl.constexpr):
    """`v / sc` for a cast to e4m3 (`sc` broadcast against `v`): see `e4m3_group_quant`.

    On the GPU: the quotient by the group's correctly rounded reciprocal, then one
    remainder step (Markstein's): r = v - q*sc is exact in fp32 (one FMA), and q + r/sc
    rounds to v/sc. Where v/sc is representable (every tie of the e4m3 grid is) the result is
    exactly v/sc; elsewhere it is IEEE's quotient unless v/sc lies within about 2^-40 of a
    midpoint between two fp32 values, too close for a cast to e4m3 to tell. Two FMAs per
    element: `tl.div_rn` per element is exact too, but made the activation glue 1.5-2.4x
    slower on an H200 (docs/device-runs/2026-11-28-session48)."""
    if EXACT_ROUND:
        return round_to_e4m3_grid(tl.minimum(tl.maximum(v / sc, -448.0), 448.0))
    else:
        inv = tl.div_rn(1.0, sc)  # once per group (sc is broadcast)
        q = v * inv
        return tl.fma(tl.fma(-q, sc, v), inv, q)


@triton.jit
def e4m3_group_quant(v, UE8M0: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """One 1x128 FP8 group per row of `v` (float32 [R, 128]): (q, scale) with scale =
    amax / 448 (UE8M0: rounded up to a power of two) and q = v / scale saturated to +-448;
    q is meant for a cast to e4m3.

    On the GPU q is v / scale (`e4m3_scaled`: a reciprocal and one remainder step, exact
    where it matters), unclamped: |v| <= amax, so q exceeds 448 by rounding only, and the cast
    to e4m3 rounds that back to 448 (no min/max per element: the quantizing scatter kept the
    ALU pipe busier than it kept memory, docs/device-runs/2026-11-23-session8). Until session
    48 q was v times the group's reciprocal scale alone, one ulp off at times; bf16 inputs put
    many quotients exactly on the e4m3 grid's ties, and that ulp broke them the other way
    (docs/device-runs/2026-11-28-session48). Scale and q are the reference's bit for bit.
    Interpreted (EXACT_ROUND): the reference's division and clamp, with the grid's rounding
    written out."""
    sc = e4m3_scale(tl.max(tl.abs(v), axis=1), UE8M0)
    return e4m3_scaled(v, sc[:, None], EXACT_ROUND), sc


@triton.jit
def e4m3_groups_quant(v, R: tl.constexpr, K: tl.constexpr, UE8M0: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """`e4m3_group_quant` over K adjacent 1x128 groups per row: float32 `v [R, K*128]` ->
    (q `[R, K*128]`, scales `[R, K]`), from one load of K groups (the token-row scatter quantizes
    four at a time: docs/device-runs/2026-11-24-session24)."""
    if K == 1:
        q, sc = e4m3_group_quant(v, UE8M0, EXACT_ROUND)
        return q, sc[:, None]
    else:
        v3 = tl.reshape(v, (R, K, 128))
        sc = e4m3_scale(tl.max(tl.abs(v3), axis=2), UE8M0)
        return tl.reshape(e4m3_scaled(v3, sc[:, :, None], EXACT_ROUND), (R, K * 128)), sc


@triton.jit
def repeat_rows(v, R: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """`v [R, C]` -> `[R*K, C]`, each row repeated K times in a row (torch's
    `repeat_interleave(K, 0)`)."""
    return tl.reshape(tl.broadcast_to(v[:, None, :], (R, K, C)), (R * K, C))


@triton.jit
def e4m3_static_quant(v, sc, EXACT_ROUND: tl.constexpr):
    """fp32 `v` -> e4m3 values (still fp32) with a static per-tensor scale `sc`: v / sc
    saturated to +-448, as `moehal.quant.fp8.quantize_tensor` does (the portable fused MoE's
    `_static_fp8` for e4m3fn). Unlike a group's own scale, a static one does not bound
    |v / sc|, so the clamp is needed on the GPU too."""
    return _static_fp8(v, sc, 448.0, 0.015625, EXACT_ROUND)


@triton.jit
def round_to_bf16_grid(v):
    """Round float32 to the nearest bfloat16 value (ties to even), still as float32.

    Only used under the Triton interpreter, whose bf16 cast truncates."""
    return _bf16_grid(v)


@triton.jit
def zero_stale_rows(
    base_ptr,
    stride_m,
    c_lo,
    c_hi,
    cnt,
    prev,
    split,
    N_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Zero rows [cnt, prev) x columns [c_lo, c_hi) of one expert's rows (row m at
    base_ptr + m * stride_m). This program takes row blocks split, split + N_SPLIT, ... so
    that a large shrink (prefill, then decode) is spread over N_SPLIT programs."""
    for r0 in range(cnt + split * BLOCK_R, prev, N_SPLIT * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ptrs = base_ptr + rows[:, None].to(tl.int64) * stride_m
        for c0 in range(c_lo, c_hi, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            tl.store(
                ptrs + cols[None, :],
                tl.zeros((BLOCK_R, BLOCK_C), dtype=base_ptr.dtype.element_ty),
                mask=(rows[:, None] < prev) & (cols[None, :] < c_hi),
            )


@triton.jit
def publish_rows(state_ptr, e, cnt, E, ARRIVALS: tl.constexpr):
    """Record `cnt` as expert e's live rows once all ARRIVALS programs that read the previous
    count in this launch are done with it: the last one to arrive (acq_rel atomic, so every
    other program's read happened before) writes the count and resets the arrival counter.
    `state_ptr`: int32 [2, E] (counts, arrivals)."""
    if ARRIVALS == 1:
        tl.store(state_ptr + e, cnt)
    else:
        arrived = tl.atomic_add(state_ptr + E + e, 1)
        if arrived == ARRIVALS - 1:
            tl.store(state_ptr + e, cnt)
            tl.store(state_ptr + E + e, 0)


@triton.jit
def masked_row_tile(t, masked_m_ptr, E: tl.constexpr, E_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tile t of the masked layout's live rows, computed from masked_m on the device (expert e
    owns ceil(masked_m[e] / BLOCK_R) consecutive tiles): (expert, rows, live mask). Past the
    last live tile the expert is >= E and no row is live (clamp before addressing). Grids sized
    by `moehal.kernels.triton_grouped_gemm.num_m_tiles` cover every tile."""
    j = tl.arange(0, E_P)
    cnt = tl.load(masked_m_ptr + j, mask=j < E, other=0)
    tiles = (cnt + BLOCK_R - 1) // BLOCK_R
    ends = tl.cumsum(tiles, axis=0)
    e = tl.sum((ends <= t).to(tl.int32), axis=0)
    first = tl.sum(tl.where(j < e, tiles, 0), axis=0)
    rows = tl.sum(tl.where(j == e, cnt, 0), axis=0)
    m = (t - first) * BLOCK_R + tl.arange(0, BLOCK_R)
    return e, m, m < rows  # past the last tile, rows == 0 (e >= E)


@fast_launch
@triton.jit
def _expert_chunk_counts(ids_ptr, chunk_counts_ptr, num_slots, expert_start, n_chunks, CHUNK: tl.constexpr):
    """chunk_counts[e, c] = slots of local expert e among slots [c*CHUNK, (c+1)*CHUNK)."""
    e = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32) - expert_start
    tl.store(chunk_counts_ptr + e * n_chunks + c, tl.sum((ids == e).to(tl.int32), axis=0))


@fast_launch
@triton.jit
def _expert_positions(
    ids_ptr,
    slot_pos_ptr,
    counts_ptr,
    chunk_counts_ptr,
    num_slots,
    expert_start,
    n_chunks,
    seg_start_ptr,
    CHUNK: tl.constexpr,
    C_P: tl.constexpr,
    SEG_ALIGN: tl.constexpr,
    E_P: tl.constexpr,
):
    """Program (e, c): positions of expert e's slots in chunk c (the expert's slots in earlier
    chunks, from `_expert_chunk_counts`, plus the rank within the chunk); program (e, 0) also
    writes the expert's count. One chunk: no counts pass, the chunk's own sum is the count.
    SEG_ALIGN > 0 (several chunks): program (e, 0) also writes where expert e's segment starts
    in a contiguous layout whose segments are aligned to SEG_ALIGN rows (every expert's count
    is known from the counts pass), so the scatter reads it instead of summing over experts
    per slot."""
    e = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inb = offs < num_slots
    ids = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int32) - expert_start
    hit = ((ids == e) & inb).to(tl.int32)
    if C_P > 1:
        cc = tl.arange(0, C_P)
        per_chunk = tl.load(chunk_counts_ptr + e * n_chunks + cc, mask=cc < n_chunks, other=0)
        base = tl.sum(tl.where(cc < c, per_chunk, 0), axis=0)
        total = tl.sum(per_chunk, axis=0)
    else:
        base = 0
        total = tl.sum(hit, axis=0)
    tl.store(slot_pos_ptr + offs, base + tl.cumsum(hit, axis=0) - 1, mask=hit != 0)
    if c == 0:
        tl.store(counts_ptr + e, total)
        if SEG_ALIGN > 0:
            jj = tl.arange(0, E_P)
            ck = tl.arange(0, C_P)
            live = (jj[:, None] < tl.num_programs(0)) & (ck[None, :] < n_chunks)
            every = tl.load(chunk_counts_ptr + jj[:, None] * n_chunks + ck[None, :], mask=live, other=0)
            aligned = (tl.sum(every, axis=1) + SEG_ALIGN - 1) // SEG_ALIGN * SEG_ALIGN
            tl.store(seg_start_ptr + e, tl.sum(tl.where(jj < e, aligned, 0), axis=0))


@fast_launch
@triton.jit
def _scatter_rows(
    x_ptr,
    stride_xt,
    ids_ptr,
    w_ptr,
    slot_pos_ptr,
    counts_ptr,
    slot_row_ptr,
    out_ptr,
    stride_oe,
    stride_om,
    scale_ptr,
    stride_se,
    stride_sm,
    stride_sg,
    static_ptr,
    row_expert_ptr,
    seg_start_ptr,
    written_ptr,
    state_ptr,
    num_slots,
    num_rows,
    max_m,
    expert_start,
    n_slot_programs,
    n_hchunks,
    H,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    E_P: tl.constexpr,
    ALIGN: tl.constexpr,
    MASKED: tl.constexpr,
    N_SPLIT: tl.constexpr,
    FUSED_POS: tl.constexpr,
    S_P: tl.constexpr,
    QUANT: tl.constexpr,
    UE8M0: tl.constexpr,
    STATIC: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    H_SPAN: tl.constexpr,
    STEP: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    MARK_PADDING: tl.constexpr,
    SEG_GIVEN: tl.constexpr,
    ROW_BLOCKS_IN_SEGMENT: tl.constexpr,
):
    # FUSED_POS (masked, small batches): no `_expert_positions` launch before this one; each
    # program derives what it needs from all S_P slot ids (a decode step has a few dozen).
    # SEG_GIVEN (contiguous): the positions pass wrote each expert's segment start; slot
    # programs read it, without the per-program sums over every expert (2x the scatter's time
    # at 128 experts, docs/device-runs/2026-11-25-session32).
    pid = tl.program_id(0)
    j = tl.arange(0, E_P)
    if FUSED_POS:
        every = tl.arange(0, S_P)
        all_ids = tl.load(ids_ptr + every, mask=every < num_slots, other=-1).to(tl.int32) - expert_start
    if pid < n_slot_programs:
        # ---- slots -> rows ----
        # program = (block of BLOCK_S slots) x (H_SPAN columns): parallel over H for small batches
        hc = pid % n_hchunks
        s = (pid // n_hchunks) * BLOCK_S + tl.arange(0, BLOCK_S)
        sin = s < num_slots
        local = tl.load(ids_ptr + s, mask=sin, other=-1).to(tl.int32) - expert_start
        valid = sin & (local >= 0) & (local < E)
        if FUSED_POS:  # position = earlier slots of the same expert (slots keep their order)
            earlier = (all_ids[None, :] == local[:, None]) & (every[None, :] < s[:, None])
            pos = tl.sum(earlier.to(tl.int32), axis=1)
        else:
            pos = tl.load(slot_pos_ptr + s, mask=valid, other=0)
        if MASKED:
            # an expert holds at most max_m rows: more arrive only from ids that break the
            # contract (a token naming one expert twice, unchecked without validate_values);
            # those slots are dropped (row -1) rather than written into the next expert's rows
            # or past the buffer
            valid = valid & (pos < max_m)
            dest_e = tl.where(valid, local, 0)
            dest_m = pos
            row_id = dest_e * max_m + dest_m
        else:
            if SEG_GIVEN:
                start = tl.load(seg_start_ptr + tl.where(valid, local, 0), mask=valid, other=0)
            else:
                counts = tl.load(counts_ptr + j, mask=j < E, other=0)
                aligned = (counts + ALIGN - 1) // ALIGN * ALIGN
                start = tl.sum(tl.where(j[None, :] < local[:, None], aligned[None, :], 0), axis=1)
            dest_e = tl.zeros_like(pos)
            dest_m = start + pos
            row_id = dest_m
        if hc == 0:
            tl.store(slot_row_ptr + s, tl.where(valid, row_id, -1), mask=sin)
        tok = s // TOP_K
        if WEIGHT_ON_INPUT:
            wt = tl.load(w_ptr + s, mask=valid, other=0.0).to(tl.float32)
        # STEP columns per load: STEP // BLOCK_H quantization groups at a time
        KG: tl.constexpr = STEP // BLOCK_H
        if STATIC:  # the layer's static input scale, in every group's slot: loaded once
            sc1 = tl.load(static_ptr)
            sc_static = tl.zeros((BLOCK_S, KG), dtype=tl.float32) + sc1
        for h1 in tl.static_range(0, H_SPAN, STEP):
            h0 = hc * H_SPAN + h1
            cols = h0 + tl.arange(0, STEP)
            cm = cols < H
            m2 = valid[:, None] & cm[None, :]
            dst = out_ptr + dest_e[:, None].to(tl.int64) * stride_oe + dest_m[:, None].to(tl.int64) * stride_om
            g = h0 // BLOCK_H + tl.arange(0, KG)  # (quantizing) the groups of this load
            sdst = scale_ptr + dest_e.to(tl.int64) * stride_se + dest_m.to(tl.int64) * stride_sm
            gm = valid[:, None] & (g * BLOCK_H < H)[None, :]
            if TOKEN_ROWS:
                # the block's slots are the top-k slots of BLOCK_S // TOP_K whole tokens: each
                # token row is loaded (and quantized) once and repeated for its slots, not
                # loaded TOP_K times through L2
                tr = (pid // n_hchunks) * (BLOCK_S // TOP_K) + tl.arange(0, BLOCK_S // TOP_K)
                tm = (tr < num_slots // TOP_K)[:, None] & cm[None, :]
                vt = tl.load(x_ptr + tr[:, None].to(tl.int64) * stride_xt + cols[None, :], mask=tm, other=0.0)
                if QUANT:
                    if STATIC:
                        qt = e4m3_static_quant(vt.to(tl.float32), sc1, EXACT_ROUND)
                        sct = sc_static
                    else:
                        qt, sct0 = e4m3_groups_quant(vt.to(tl.float32), BLOCK_S // TOP_K, KG, UE8M0, EXACT_ROUND)
                        sct = repeat_rows(sct0, BLOCK_S // TOP_K, TOP_K, KG)
                    qs = repeat_rows(qt.to(out_ptr.dtype.element_ty), BLOCK_S // TOP_K, TOP_K, STEP)
                    tl.store(dst + cols[None, :], qs, mask=m2)
                    tl.store(sdst[:, None] + g[None, :] * stride_sg, sct, mask=gm)
                else:
                    tl.store(dst + cols[None, :], repeat_rows(vt, BLOCK_S // TOP_K, TOP_K, STEP), mask=m2)
            else:
                v = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_xt + cols[None, :], mask=m2, other=0.0)
                if WEIGHT_ON_INPUT:
                    vw = v.to(tl.float32) * wt[:, None]
                    if EXACT_ROUND:  # the interpreter's cast to bf16 is not round-to-nearest-even
                        if x_ptr.dtype.element_ty == tl.bfloat16:  # (fp16 and fp32 casts are)
                            vw = round_to_bf16_grid(vw)
                    v = vw.to(x_ptr.dtype.element_ty)
                if QUANT:
                    if STATIC:
                        q = e4m3_static_quant(v.to(tl.float32), sc1, EXACT_ROUND)
                        sc = sc_static
                    else:
                        q, sc = e4m3_groups_quant(v.to(tl.float32), BLOCK_S, KG, UE8M0, EXACT_ROUND)
                    tl.store(dst + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=m2)
                    tl.store(sdst[:, None] + g[None, :] * stride_sg, sc, mask=gm)
                else:
                    tl.store(dst + cols[None, :], v, mask=m2)
    elif MASKED:
        # ---- stale rows: program (expert, split) zeroes its share of [count now, before) ----
        rp = pid - n_slot_programs
        e = rp // N_SPLIT
        if FUSED_POS:
            cnt = tl.minimum(tl.sum((all_ids == e).to(tl.int32), axis=0), max_m)
            if rp % N_SPLIT == 0:
                tl.store(counts_ptr + e, cnt)  # masked_m for the experts' kernels
        else:
            # the positions pass counted every slot; the experts' kernels read the rows held
            # (see the slots' note on max_m)
            cnt = tl.minimum(tl.load(counts_ptr + e), max_m)
            if rp % N_SPLIT == 0:
                tl.store(counts_ptr + e, cnt)
        prev = tl.load(state_ptr + e)
        base = out_ptr + e.to(tl.int64) * stride_oe
        zero_stale_rows(base, stride_om, 0, H, cnt, prev, rp % N_SPLIT, N_SPLIT, BLOCK_R, BLOCK_H)
        publish_rows(state_ptr, e, cnt, E, N_SPLIT)
    else:
        # ---- contiguous row bookkeeping: row expert ids, segment starts, stale padding rows ----
        counts = tl.load(counts_ptr + j, mask=j < E, other=0)
        aligned = (counts + ALIGN - 1) // ALIGN * ALIGN
        seg_end = tl.cumsum(aligned, axis=0)
        rp = pid - n_slot_programs
        r = rp * BLOCK_R + tl.arange(0, BLOCK_R)
        rin = r < num_rows
        if ROW_BLOCKS_IN_SEGMENT:  # BLOCK_R divides ALIGN: the block's rows share one segment
            seg1 = tl.sum((seg_end <= rp * BLOCK_R).to(tl.int32), axis=0)
            seg = tl.zeros_like(r) + seg1
            seg_start_r = tl.zeros_like(r) + tl.sum(tl.where(j < seg1, aligned, 0), axis=0)
            cnt_r = tl.zeros_like(r) + tl.sum(tl.where(j == seg1, counts, 0), axis=0)
        else:
            seg = tl.sum((seg_end[None, :] <= r[:, None]).to(tl.int32), axis=1)
            seg_start_r = tl.sum(tl.where(j[None, :] < seg[:, None], aligned[None, :], 0), axis=1)
            cnt_r = tl.sum(tl.where(j[None, :] == seg[:, None], counts[None, :], 0), axis=1)
        has = rin & (seg < E)
        new_valid = has & (r - seg_start_r < cnt_r)
        marked = has
        if MARK_PADDING:  # padding rows of a segment read -1, as its unused tail does
            marked = new_valid
        tl.store(row_expert_ptr + r, tl.where(marked, seg, -1), mask=rin)
        if rp == 0 and not SEG_GIVEN:
            tl.store(seg_start_ptr + j, seg_end - aligned, mask=j < E)
        prev = tl.load(written_ptr + r, mask=rin, other=0)
        stale = rin & (prev != 0) & (~new_valid)
        if tl.max(stale.to(tl.int32), axis=0) > 0:
            base = out_ptr + r[:, None].to(tl.int64) * stride_om
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                zero = tl.zeros((BLOCK_R, BLOCK_H), dtype=out_ptr.dtype.element_ty)
                tl.store(base + cols[None, :], zero, mask=stale[:, None] & (cols[None, :] < H))
        tl.store(written_ptr + r, new_valid.to(tl.int8), mask=rin)


@fast_launch
@triton.jit
def _combine_rows(
    y_ptr,
    stride_ye,
    stride_ym,
    slot_row_ptr,
    w_ptr,
    out_ptr,
    stride_ot,
    max_m,
    H,
    scaling,
    TOP_K: tl.constexpr,
    K_P: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WEIGHTS: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # All top-k rows of a token are loaded as one [K_P, BLOCK_H] tile: one round of memory
    # latency per token instead of top_k dependent ones (decode steps are latency-bound).
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cm = cols < H
    kk = tl.arange(0, K_P)
    km = kk < TOP_K
    slot = t.to(tl.int64) * TOP_K + kk
    row = tl.load(slot_row_ptr + slot, mask=km, other=-1)
    ok = row >= 0
    row = tl.where(ok, row, 0)
    if MASKED:
        base = y_ptr + (row // max_m).to(tl.int64) * stride_ye + (row % max_m).to(tl.int64) * stride_ym
    else:
        base = y_ptr + row.to(tl.int64) * stride_ym
    v = tl.load(base[:, None] + cols[None, :], mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if USE_WEIGHTS:
        v = v * tl.load(w_ptr + slot, mask=ok, other=0.0).to(tl.float32)[:, None]
    acc = tl.sum(v, axis=0) * scaling
    if EXACT_ROUND:
        acc = round_to_bf16_grid(acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)


# --- host side ------------------------------------------------------------------------------


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when contiguous: the kernels index ids and router weights `[T, K]` flat, so a
    contiguous tensor needs no reshape (a reshape per call is host time at decode sizes)."""
    return t if t.is_contiguous() else t.contiguous()


@dataclass
class PaddedBuffer:
    """A persistent destination (hidden rows, optional scales) and its record of the rows the
    previous call wrote: per expert for masked buffers, per row for contiguous ones.

    scales are stored MN-major (the last two dims swapped in memory), the layout DeepGEMM's
    TMA loads want for per-token-group scale factors, so no transform runs per call on SM90
    (SM100's kernels read packed UE8M0 scales: DeepGEMM packs these fp32 ones per call).
    """

    hidden: torch.Tensor  # [E, M, H] (masked) or [M, H] (contiguous)
    scales: torch.Tensor | None  # [E, M, H/128] or [M, H/128] view, MN-major
    written: torch.Tensor  # contiguous: int8 [M * bitmap_cols] written-rows bitmap; masked: empty
    expert_rows: torch.Tensor | None = None  # masked: int32 [2, E] (live rows per expert, arrivals)
    # masked: int32 [E], where each dispatch writes its rows per expert (the experts' masked_m).
    # Persistent like `hidden`, so a decode loop hands the GEMMs the same tensors every call and
    # their host calls can be replayed from graphs (`moehal.graphs.LaunchMemo`).
    counts: torch.Tensor | None = None
    _prefixes: dict[int, PaddedBuffer] = field(default_factory=dict, repr=False)

    @property
    def masked(self) -> bool:
        return self.hidden.dim() == 3

    def prefix(self, rows: int) -> PaddedBuffer:
        """Rows `[0, rows)` of a contiguous buffer as a buffer of its own: views of the same
        rows and bitmap cells, so the stale-row bookkeeping carries over between calls of
        different sizes, and GEMMs over it cost what this call's rows cost, not the capacity's.
        Scales are re-strided onto the same storage, MN-major and TMA-aligned for `rows`
        (DeepGEMM checks the stride of the scales against the GEMM's M)."""
        m = self.hidden.shape[0]
        if self.masked or rows == m:
            return self
        if rows > m:
            raise ValueError(f"a prefix of {rows} rows of a {m}-row buffer")
        view = self._prefixes.get(rows)
        if view is None:
            scales = None
            if self.scales is not None:
                scales = self.scales.as_strided((rows, self.scales.shape[1]), (1, round_up(rows, 4)))
            cells = self.written.numel() // m
            view = self._prefixes[rows] = PaddedBuffer(self.hidden[:rows], scales, self.written[: rows * cells])
        return view


def alloc_padded(
    lead: tuple[int, ...], cols: int, dtype: torch.dtype, device: torch.device, quant: bool, bitmap_cols: int = 1
) -> PaddedBuffer:
    with persistent_tensors():
        return _alloc_padded(lead, cols, dtype, device, quant, bitmap_cols)


def _alloc_padded(
    lead: tuple[int, ...], cols: int, dtype: torch.dtype, device: torch.device, quant: bool, bitmap_cols: int
) -> PaddedBuffer:
    hidden = torch.zeros(*lead, cols, dtype=dtype, device=device)
    scales = None
    if quant:
        g = cdiv(cols, QUANT_GROUP)
        m = lead[-1]
        raw = torch.zeros(*lead[:-1], g, round_up(m, 4), dtype=torch.float32, device=device)
        scales = raw.transpose(-1, -2)[..., :m, :]
    if len(lead) == 2:  # masked: live rows are a prefix per expert, one count each suffices
        state = torch.zeros(2, lead[0], dtype=torch.int32, device=device)
        counts = torch.zeros(lead[0], dtype=torch.int32, device=device)
        return PaddedBuffer(hidden, scales, torch.zeros(0, dtype=torch.int8, device=device), state, counts)
    return PaddedBuffer(hidden, scales, torch.zeros(lead[0] * bitmap_cols, dtype=torch.int8, device=device))


def stale_splits(max_m: int, block_r: int, num_experts: int) -> int:
    """Programs per expert that zero stale rows: enough that a prefill-to-decode shrink (up to
    max_m rows per expert) spreads over a few hundred programs, few enough that a decode step
    does not launch many idle ones (many experts need fewer splits each)."""
    return max(1, min(4, cdiv(256, max(num_experts, 1)), cdiv(max_m, 8 * block_r)))


_WORKSPACE: dict[tuple, PaddedBuffer] = {}


def _device_key(device: torch.device | str) -> torch.device:
    """`device` as tensors record it: "cuda" is the current CUDA device, with its index (so that
    `release_workspaces("cuda")` finds the buffers of tensors on cuda:0)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def workspace(
    role: str,
    lead: tuple[int, ...],
    cols: int,
    dtype: torch.dtype,
    device: torch.device,
    quant: bool,
    bitmap_cols: int = 1,
) -> PaddedBuffer:
    """A process-wide persistent buffer per (role, shape, dtype, device): MoE layers run one
    after another on a stream, so layers of equal shape share one (memory stays O(1) in the
    number of layers). Not for concurrent use from two streams: `MoELayer` runs its forwards
    in one order across streams (`moehal.stream_order`); callers of the kernels themselves
    order their own. `bitmap_cols`: cells per row
    of a contiguous buffer's written-rows bitmap (kernels that split rows over column chunks
    keep one each)."""
    dev = _device_key(device)
    key = (role, lead, cols, dtype, dev, quant, bitmap_cols)
    buf = _WORKSPACE.get(key)
    if buf is None:
        buf = _WORKSPACE[key] = alloc_padded(lead, cols, dtype, dev, quant, bitmap_cols)
    note_fetched(buf)
    return buf


_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A process-wide tensor per (role, shape, dtype, device), for what a call writes before it
    reads and drops after its forward (a decode step's slot rows, the token-major kernels'
    activation rows): a `torch.empty` per call cost an eager decode step 2.3 us of host time
    on an H200 host (docs/device-runs/2026-11-25-session28). The same rule as `workspace`: not
    for concurrent use from two streams (`moehal.stream_order`). For launches bound per token count and kept (decode
    sizes), so the shapes a process sees stay few."""
    key = (role, shape, dtype, _device_key(device))
    buf = _SCRATCH.get(key)
    if buf is None:
        with persistent_tensors():
            buf = _SCRATCH[key] = torch.empty(shape, dtype=dtype, device=device)
    note_fetched(buf)
    return buf


# Arrival counters of kernels whose programs meet to finish a piece of work (the token-major
# split combine, the fused FP8 GEMM1's narrow tiles): zero between launches, as each launch's
# last program re-arms its cells, so launches queued on one stream may share them. Kept for the
# process's life: a CUDA graph may have captured any of them.
_ARRIVALS: list[torch.Tensor] = []


def arrivals(cells: int, device: torch.device) -> torch.Tensor:
    """At least `cells` int32 arrival counters on `device`, all zero between launches."""
    for a in _ARRIVALS:
        if a.device == device and a.numel() >= cells:
            return a
    with persistent_tensors():
        a = torch.zeros(max(cells, 4096), dtype=torch.int32, device=device)
    _ARRIVALS.append(a)
    return a


def release_workspaces(device: torch.device | str | None = None) -> int:
    """Forget the process-wide workspaces and `scratch` (of `device`, or of every device) and
    return the bytes they held. For a process done with one model's layers that builds others:
    a benchmark moving to another shape or batch bound, an engine unloading a model. The memory
    is freed once the old layers, which keep the buffers they bound, are gone; layers built
    afterwards allocate their own. Without it, every (shape, max_tokens) a process ever built
    keeps its buffers: `moehal bench` ran an H100 out of memory that way after 60 rows of three
    shapes (docs/device-runs/2026-11-24-session25).

    CUDA graphs that moehal captured (`cuda_graph_tokens`) keep the buffers they write; graphs
    that the caller captured do not. Drop those first, or do not release a device whose
    captured layers will replay again: a layer that fetches a buffer per call holds no
    reference to it, so a replay would write freed memory."""
    dev = None if device is None else _device_key(device)
    held = 0
    # (snapshots of the keys, popped with a default: a forward in another thread may add one,
    # and another release may take one, while this runs)
    for key in [k for k in list(_WORKSPACE) if dev is None or k[4] == dev]:
        buf = _WORKSPACE.pop(key, None)
        if buf is None:
            continue
        held += sum(
            t.untyped_storage().nbytes()
            for t in (buf.hidden, buf.scales, buf.written, buf.expert_rows, buf.counts)
            if t is not None
        )
    for key in [k for k in list(_SCRATCH) if dev is None or k[3] == dev]:
        t = _SCRATCH.pop(key, None)
        held += t.untyped_storage().nbytes() if t is not None else 0
    return held


def contiguous_workspace(
    role: str,
    rows: int,
    capacity: int,
    cols: int,
    dtype: torch.dtype,
    device: torch.device,
    quant: bool,
    bitmap_cols: int = 1,
) -> PaddedBuffer:
    """Rows `[0, rows)` of the persistent contiguous buffer of `role`, allocated once with
    `capacity` rows (a static worst case such as max_tokens' rows). A call past it gets a
    buffer of the next power of two of its rows: an expert-parallel rank receives a different
    number of rows at every call, and a buffer per size would grow without bound; this way a
    stream of sizes keeps at most a few buffers, within 2x of the largest. Sized per call, not
    by the capacity: DeepGEMM's contiguous GEMM computes every row it is given, so a 1024-token
    prefill in a 4096-token buffer cost as much as a 4096-token one
    (docs/device-runs/2026-11-23-session6)."""
    if rows > capacity:
        capacity = next_power_of_2(rows)
    full = workspace(role, (capacity,), cols, dtype, device, quant, bitmap_cols)
    return full.prefix(rows)


@dataclass(frozen=True)
class Permuted:
    """Result of `permute`. slot_row int32 `[T*K]`: destination row of each slot (masked:
    e*max_m + m), -1 for slots whose expert is not local."""

    hidden: torch.Tensor
    scales: torch.Tensor | None
    counts: torch.Tensor  # int32 [E]
    slot_row: torch.Tensor
    row_expert: torch.Tensor | None = None  # contiguous only
    segment_start: torch.Tensor | None = None  # contiguous only


# Masked dispatches of up to this many (token, expert) slots compute positions and counts
# inside the scatter kernel (one launch instead of two: a decode step is latency-bound).
FUSED_POSITIONS_MAX_SLOTS = 256
# Slots per program of the positions pass (larger batches run several chunks per expert).
POSITION_CHUNK = 2048


def _e_pad(e: int) -> int:
    return max(16, next_power_of_2(e))


@dataclass(frozen=True)
class ScatterTile:
    block_s: int  # slots per program
    h_span: int  # columns per program (a multiple of the column block)
    num_warps: int = 4
    # column blocks per load (a power of two dividing h_span / column block); quantizing
    # scatters quantize this many 1x128 groups at a time
    blocks_per_load: int = 1
    # load each token's row once for its top-k slots (and quantize it once) where the batch
    # allows it: a power-of-two top-k dividing block_s, no router weight applied on the way in
    token_rows: bool = False


def scatter_tile(slots: int, h: int, block_h: int, *, quant: bool = False, top_k: int = 1) -> ScatterTile:
    """The scatter kernel's tile. A program copies `h_span` columns of `block_s` slots; small
    batches take one column block per program, so each program is a single round of memory
    latency (decode is latency-bound).

    Quantizing prefill batches (4096+ slots) whose top-k is a power of two dividing 16 load each
    token's row once for its top-k slots, four 1x128 groups per load, and quantize it once: on
    an H200 at Qwen3-30B-A3B's 2048-4096 tokens (top-8) the scatter took 15.2-29.3 us instead
    of 19.5-39.2 us (docs/device-runs/2026-11-24-session24). Unquantized scatters gained at
    most 3-4%, within their spread between traces, and keep the slot tile."""
    block_s = 16 if slots >= 4096 else 4
    if cdiv(slots, block_s) < 64:
        return ScatterTile(block_s, block_h)
    blocks = min(8, cdiv(h, block_h))
    if quant and slots >= 4096 and 16 % top_k == 0:  # (top_k | 16: a power of two up to 16)
        loads = next(n for n in (4, 2, 1) if blocks % n == 0)
        return ScatterTile(16, blocks * block_h, 4, loads, token_rows=True)
    return ScatterTile(block_s, blocks * block_h)


def expert_positions(
    ids: torch.Tensor, num_local_experts: int, expert_start: int = 0, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat expert ids `[S]` (contiguous), on the device and without a host sync:
    slot_pos int32 `[max(S, 1)]`, each local slot's position among its expert's slots (stable in
    slot order; other slots' entries are left unwritten), and counts int32 `[E]`, the local
    experts' slot counts (written into `counts` when given). Ids outside
    [expert_start, expert_start + E) belong to no expert."""
    return bind_positions(ids.numel(), num_local_experts, expert_start)(ids, counts)


def _position_chunk(num_slots: int) -> int:
    """Slots per program of the positions pass. Program (expert, chunk of slots): one pass over
    its chunk, after a counts pass when there are several chunks (a prefill's 32k slots: 16
    chunks in parallel, not 8 serial scan steps per expert)."""
    return min(POSITION_CHUNK, max(256, next_power_of_2(num_slots)))


def bind_positions(
    num_slots: int, num_local_experts: int, expert_start: int = 0, segment_alignment: int = 0
) -> BoundPositions:
    """`expert_positions`' launches for `num_slots` slots and `num_local_experts` experts: chunks
    and grid decided once (a bound permute or align pass keeps one). `segment_alignment` > 0:
    batches of several chunks also write each expert's segment start in a contiguous layout
    aligned to that many rows (`BoundPositions.segments`)."""
    s = num_slots
    chunk = _position_chunk(s)
    # At least one chunk: with no slots, each expert's program still writes its count, 0. A grid
    # of no programs left `counts` as torch.empty found it, and a contiguous layout built on that
    # garbage sent DeepGEMM to an illegal instruction (docs/device-runs/2026-11-25-session33).
    n_chunks = max(1, cdiv(s, chunk))
    kw = dict(CHUNK=chunk)
    seg_align = segment_alignment if n_chunks > 1 else 0  # one chunk: no counts pass to read
    return BoundPositions(
        s, num_local_experts, n_chunks, (s, expert_start, n_chunks), (num_local_experts, n_chunks), kw,
        dict(kw, C_P=next_power_of_2(n_chunks) if n_chunks > 1 else 1, SEG_ALIGN=seg_align,
             E_P=_e_pad(num_local_experts)),
    )  # fmt: skip


@dataclass(frozen=True)
class BoundPositions:
    """`expert_positions` for one slot count and expert range (`bind_positions`)."""

    slots: int
    experts: int
    n_chunks: int
    scalars: tuple[int, int, int]  # slots, the first local expert, chunks
    grid: tuple[int, int]
    counts_kw: dict
    kw: dict

    @property
    def segments(self) -> bool:
        """Whether a call writes the segment starts (`seg_start`)."""
        return self.kw["SEG_ALIGN"] > 0

    def __call__(
        self, ids: torch.Tensor, counts: torch.Tensor | None = None, seg_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: the flat, contiguous `[S]` expert ids -> (slot_pos, counts), as `expert_positions`;
        with `segments`, each expert's segment start is written into `seg_start` int32 `[E]`."""
        e, dev = self.experts, ids.device
        if counts is None:
            counts = torch.empty(e, dtype=torch.int32, device=dev)
        if self.segments and seg_start is None:
            raise ValueError("these positions write segment starts: pass seg_start")
        slot_pos = torch.empty(max(self.slots, 1), dtype=torch.int32, device=dev)
        chunk_counts = counts
        if self.n_chunks > 1:
            chunk_counts = torch.empty(e * self.n_chunks, dtype=torch.int32, device=dev)
            self._counts_site(ids, chunk_counts, *self.scalars)
        seg = seg_start if self.segments else counts  # (a pointer the kernel then never reads)
        self._site(ids, slot_pos, counts, chunk_counts, *self.scalars, seg)
        return slot_pos, counts

    @functools.cached_property
    def _counts_site(self) -> Site:  # the pinned launches (host time: `moehal.kernels.launch.Site`)
        return site(_expert_chunk_counts, self.grid, **self.counts_kw)

    @functools.cached_property
    def _site(self) -> Site:
        return site(_expert_positions, self.grid, **self.kw)


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    dest: PaddedBuffer,
    *,
    expert_start: int,
    num_local_experts: int,
    masked: bool,
    alignment: int = 1,
    ue8m0: bool = False,
    weight_on_input: bool = False,
    static_scale: torch.Tensor | None = None,
) -> Permuted:
    """Scatter token rows `x [T, H]` to `dest` (masked `[E, max_m, H]` or contiguous
    `[M_pad, H]`), quantizing to FP8 if `dest` has scales: in 1x128 groups with scales of their
    own, or, with `static_scale` (fp32, one element), with that scale, written to every group's
    slot (`ScaleKind.STATIC_TENSOR`). No host sync.
    (`bind_permute` decides the launches; this binds and calls in one go.)"""
    t, h = x.shape
    bound = bind_permute(
        t, topk_ids.shape[1], h, dest, expert_start=expert_start, num_local_experts=num_local_experts,
        masked=masked, alignment=alignment, ue8m0=ue8m0, weight_on_input=weight_on_input, static_scale=static_scale,
    )  # fmt: skip
    return bound(x, topk_ids, topk_weights)


def bind_permute(
    t: int,
    top_k: int,
    h: int,
    dest: PaddedBuffer,
    *,
    expert_start: int,
    num_local_experts: int,
    masked: bool,
    alignment: int = 1,
    ue8m0: bool = False,
    weight_on_input: bool = False,
    static_scale: torch.Tensor | None = None,
    keep: bool = False,
) -> BoundPermute:
    """`permute`'s launches for `t` tokens of `top_k` slots and `h` columns into `dest`: tiles,
    grid and every argument but the call's tensors, decided once. An eager dispatcher keeps
    one per token count (host time of a decode step). `static_scale` is bound too: the layer's
    static input scale, a tensor whose value may change but which stays the same tensor.
    `keep`: the caller keeps this bind for its token count; its slot rows are then process-wide
    scratch (`scratch`), valid until the next dispatch of the same size, like `dest`."""
    e = num_local_experts
    s = t * top_k
    quant = dest.scales is not None
    if static_scale is not None and (not quant or ue8m0 or static_scale.numel() != 1):
        raise ValueError("static_scale quantizes into a destination with fp32 group scales, one scale value")
    fused_pos = masked and s <= FUSED_POSITIONS_MAX_SLOTS
    kept = dest.counts if masked and dest.counts is not None and dest.counts.numel() == e else None
    out = dest.hidden
    if masked:
        max_m = out.shape[1]
        num_rows = e * max_m
        so_e, so_m = out.stride(0), out.stride(1)
    else:
        max_m = 0
        num_rows = out.shape[0]
        so_e, so_m = 0, out.stride(0)
        # The scatter writes each slot at its segment's start plus its position, unchecked: a
        # destination with fewer rows than the worst case was written past its end (heap
        # corruption on the CPU, security review 2026-11-29). Sizes only, no device sync.
        need = contiguous_rows(s, e, max(alignment, 1))
        if num_rows < need:
            raise ValueError(
                f"contiguous destination has {num_rows} rows, but {t} tokens x top-{top_k} over {e} local experts "
                f"with segments aligned to {max(alignment, 1)} rows can take {need}: allocate it with "
                f"contiguous_rows({s}, {e}, {max(alignment, 1)}) rows"
            )
    if quant:
        sc = dest.scales
        assert sc is not None
        if masked:
            ss_e, ss_m, ss_g = sc.stride(0), sc.stride(1), sc.stride(2)
        else:
            ss_e, ss_m, ss_g = 0, sc.stride(0), sc.stride(1)
        block_h = QUANT_GROUP
    else:
        sc = out
        ss_e = ss_m = ss_g = 0
        block_h = min(256, next_power_of_2(h))
    tile = scatter_tile(s, h, block_h, quant=quant, top_k=top_k)
    block_s, h_span = tile.block_s, tile.h_span
    step = block_h * tile.blocks_per_load
    if h_span % step or tile.blocks_per_load & (tile.blocks_per_load - 1):
        raise ValueError(f"scatter tile {tile}: {h_span} columns per program are not whole loads of {step}")
    block_r = 64
    n_hc = cdiv(h, h_span)
    n_slot = cdiv(s, block_s) * n_hc
    if masked:
        if dest.expert_rows is None or dest.expert_rows.shape[1] != e:
            raise ValueError(f"masked destination needs per-expert row counts for {e} experts (alloc_padded)")
        n_split = stale_splits(max_m, block_r, e)
        n_row = e * n_split
    else:
        n_split = 1
        n_row = cdiv(num_rows, block_r)
    slot_rows = scratch("permute.slot_row", (max(s, 1),), torch.int32, out.device) if keep else None
    # the positions pass (none where the scatter's programs find positions themselves); for a
    # contiguous layout it also writes the segment starts where the batch takes several chunks
    positions = None if fused_pos else bind_positions(s, e, expert_start, 0 if masked else max(alignment, 1))
    return BoundPermute(
        s, e, expert_start, masked, fused_pos, kept, dest, num_rows, slot_rows, positions,
        (n_slot + n_row,) if n_slot + n_row > 0 else None,
        (out, so_e, so_m, sc, ss_e, ss_m, ss_g, static_scale if static_scale is not None else sc),
        (s, num_rows, max_m, expert_start, n_slot, n_hc, h),
        dict(
            TOP_K=top_k, E=e, E_P=_e_pad(e), ALIGN=max(alignment, 1), MASKED=masked, N_SPLIT=n_split,
            FUSED_POS=fused_pos, S_P=max(16, next_power_of_2(s)) if fused_pos else 16, QUANT=quant, UE8M0=ue8m0,
            STATIC=static_scale is not None, WEIGHT_ON_INPUT=weight_on_input, EXACT_ROUND=INTERPRETED,
            BLOCK_S=block_s, BLOCK_R=block_r,
            BLOCK_H=block_h, H_SPAN=h_span, STEP=step, num_warps=tile.num_warps,
            TOKEN_ROWS=tile.token_rows and not weight_on_input and top_k & (top_k - 1) == 0 and block_s % top_k == 0,
            MARK_PADDING=MARK_PADDING_ROWS,
            SEG_GIVEN=positions is not None and positions.segments,
            ROW_BLOCKS_IN_SEGMENT=not masked and max(alignment, 1) % block_r == 0,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class BoundPermute:
    """`permute` for one token count into one destination (`bind_permute`). A call allocates
    what each call returns (slot rows, unless the bind is kept; a contiguous layout's row
    experts and segment starts), runs the positions pass when the batch needs one, and
    launches the scatter."""

    slots: int
    experts: int
    expert_start: int
    masked: bool
    fused_pos: bool
    kept: torch.Tensor | None  # the destination's persistent per-expert counts (masked)
    dest: PaddedBuffer
    num_rows: int
    slot_rows: torch.Tensor | None  # process-wide slot rows of a kept bind, else None: one per call
    positions: BoundPositions | None  # the positions pass; None with fused positions
    grid: tuple[int] | None  # None: nothing to launch
    dest_args: tuple  # out, its strides, scales (or out), their strides, the static scale (or scales)
    scalars: tuple  # slots, rows, max_m, expert_start, slot programs, column chunks, H
    kw: dict

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None) -> Permuted:
        """x `[T, H]`, topk_ids `[T, K]`, topk_weights `[T, K]` fp32 or None, of the bound T, K, H."""
        s, e, dev = self.slots, self.experts, x.device
        ids = _dense(topk_ids)
        if x.stride(-1) != 1:
            x = x.contiguous()
        slot_row = self.slot_rows
        if slot_row is None:
            slot_row = torch.empty(max(s, 1), dtype=torch.int32, device=dev)
        row_expert = seg_start = None
        if not self.masked:
            row_expert = torch.empty(self.num_rows, dtype=torch.int32, device=dev)
            # no rows (no slots): no scatter program writes the segment starts, which are all 0
            seg_start = (torch.empty if self.grid else torch.zeros)(e, dtype=torch.int32, device=dev)
        if self.fused_pos:  # the scatter kernel's programs compare the slot ids themselves
            counts = self.kept if self.kept is not None else torch.empty(e, dtype=torch.int32, device=dev)
            slot_pos = slot_row  # not read with FUSED_POS: any int32 tensor will do
        else:
            assert self.positions is not None
            slot_pos, counts = self.positions(ids, self.kept, seg_start if self.positions.segments else None)
        if self.masked:
            re_arg = se_arg = counts  # unused
            state = self.dest.expert_rows
        else:
            re_arg, se_arg, state = row_expert, seg_start, counts  # state unused
        if self.grid is not None:
            w = ids if topk_weights is None else _dense(topk_weights)
            self._site(
                x, x.stride(0), ids, w, slot_pos, counts, slot_row, *self.dest_args, re_arg, se_arg,
                self.dest.written, state, *self.scalars,
            )  # fmt: skip
        slot_row = slot_row if s else slot_row[:0]  # (allocated with at least one element)
        return Permuted(self.dest.hidden, self.dest.scales, counts, slot_row, row_expert, seg_start)

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_scatter_rows, self.grid or (0,), **self.kw)


def combine(
    y: torch.Tensor,
    slot_row: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
    *,
    masked: bool,
    scaling: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, H]` = scaling * sum_k w[t, k] * y[slot_row[t, k]] (slots with row -1 skipped);
    y is masked `[E, max_m, H]` or contiguous `[M, H]`. Weights None: unweighted sum.
    (`bind_combine` decides the launch; this binds and calls in one go.)"""
    launch = bind_combine(
        num_tokens, top_k, y.shape[-1], masked=masked, weighted=topk_weights is not None, scaling=scaling,
        out_dtype=out.dtype if out is not None else out_dtype,
    )  # fmt: skip
    return launch(y, slot_row, topk_weights, out)


def bind_combine(
    num_tokens: int,
    top_k: int,
    h: int,
    *,
    masked: bool,
    weighted: bool,
    scaling: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
) -> BoundCombine:
    """`combine`'s launch for `num_tokens` tokens of `top_k` slots and `h` columns: grid and
    constexprs decided once. An eager dispatcher keeps one per token count, beside its
    permute (`bind_permute`)."""
    # small batches: narrower column blocks, so a decode step still spreads over many SMs
    block_h = min(1024 if num_tokens >= 64 else 256, next_power_of_2(h))
    return BoundCombine(
        num_tokens, h, masked, weighted, out_dtype, (num_tokens, cdiv(h, block_h)), float(scaling),
        dict(
            TOP_K=top_k, K_P=max(2, next_power_of_2(top_k)), MASKED=masked, USE_WEIGHTS=weighted,
            EXACT_ROUND=INTERPRETED and out_dtype == torch.bfloat16, BLOCK_H=block_h,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class BoundCombine:
    """`combine` for one token count, width and layout (`bind_combine`)."""

    num_tokens: int
    h: int
    masked: bool
    weighted: bool
    out_dtype: torch.dtype
    grid: tuple[int, int]
    scaling: float
    kw: dict

    def __call__(
        self, y: torch.Tensor, slot_row: torch.Tensor, topk_weights: torch.Tensor | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        """y masked `[E, max_m, H]` or contiguous `[M, H]`; slot_row int32 `[T * K]`; topk_weights
        `[T, K]` fp32 (None exactly when bound unweighted); out `[T, H]` with contiguous rows, or
        None (allocated)."""
        if (
            (topk_weights is not None) != self.weighted or y.shape[-1] != self.h
            or (out is not None and (out.dtype != self.out_dtype or out.stride(-1) != 1))
        ):  # fmt: skip
            raise ValueError(
                f"a combine bound for {'weighted' if self.weighted else 'unweighted'} rows of {self.h} columns into "
                f"{self.out_dtype} got {'weighted' if topk_weights is not None else 'unweighted'} rows of "
                f"{y.shape[-1]} into {out.dtype if out is not None else self.out_dtype}"
                + ("" if out is None or out.stride(-1) == 1 else f" with column stride {out.stride(-1)} (needs 1)")
            )
        if out is None:
            out = torch.empty(self.num_tokens, self.h, dtype=self.out_dtype, device=y.device)
        if self.num_tokens == 0:
            return out
        if y.stride(-1) != 1:
            y = y.contiguous()
        if self.masked:
            sy_e, sy_m, max_m = y.stride(0), y.stride(1), y.shape[1]
        else:
            sy_e, sy_m, max_m = 0, y.stride(0), 1
        w = slot_row if topk_weights is None else _dense(topk_weights)
        self._site(y, sy_e, sy_m, slot_row, w, out, out.stride(0), max_m, self.h, self.scaling)
        return out

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_combine_rows, self.grid, **self.kw)
