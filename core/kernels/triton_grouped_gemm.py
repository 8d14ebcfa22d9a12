# Triton reads annotations of @triton.jit parameters, so the kernel's parameters stay untyped:
# ruff: noqa: ANN001, ANN202
"""A masked m-grouped GEMM in Triton: the same contract as DeepGEMM's
`m_grouped_{bf16,fp8}_gemm_nt_masked`, tuned per shape and token count.

    d[e, m, :] = a[e, m, :] @ w[e]^T      for m < masked_m[e]      (rows past masked_m untouched)

Why a second implementation of one GEMM: DeepGEMM's masked kernel walks whole 64-row tiles of
every expert and keeps few SMs busy when only a handful of experts are active (decode), and
its short-K tiles (K = 768 for Qwen3-30B-A3B's down projection) are dominated by prologue and
epilogue. A Triton tile chosen for the shape streams the weights closer to the copy bandwidth
there. Which one runs is decided per GEMM shape and token count from measurements
(`moehal_cuda.tuning`), never assumed.

Tile scheduling without a host sync: every program reads `masked_m` (E values) and computes
the tile table itself: expert e owns ceil(masked_m[e] / BLOCK_M) consecutive M tiles. The
grid is sized by a static bound on the live tiles, `ceil(S / BLOCK_M) + min(E, S)` where S is
a host-known bound on sum(masked_m) (T * top_k on one GPU), so a decode step with 8 active
experts launches a few hundred programs, not E * max_m / BLOCK_M.

Quantization: bf16/fp16 (fp32 accumulate) and FP8 block scale (1x128 activation groups with
MN-major scales as DeepGEMM takes them, 128x128 weight blocks, fp32 scales).

Two more uses, for the NVFP4 experts on Hopper (`moehal_cuda.nvfp4_dequant`): a per-expert fp32
factor applied to the accumulator before the output's one rounding (`out_scale`: NVFP4's global
scales, which DeepGEMM's bf16-only outputs would round first), and the contiguous layout
(`contiguous_grouped_gemm`: expert segments aligned to the tile's rows, as DeepGEMM's
`m_grouped_*_gemm_nt_contiguous` takes them).

Interpreter (TRITON_INTERPRET=1): bf16 `tl.dot` is wrong there, so dot operands are upcast to
fp32 (UPCAST); compiled kernels never upcast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from moehal.kernels.host import cdiv, interpreting, kernel_modules_interpreted, next_power_of_2
from moehal.kernels.launch import Site, fast_launch, site
from moehal.kernels.tiles import FP8_GROUP, TileConfig
from moehal.kernels.triton_fused_moe import _activation, _grouped_tile, _to
from moehal.kernels.triton_permute import (
    arrivals,
    e4m3_groups_quant,
    e4m3_static_quant,
    masked_row_tile,
    publish_rows,
    scratch,
    stale_splits,
    zero_stale_rows,
)

INTERPRETED = kernel_modules_interpreted()  # as triton.jit decorates this module's kernels (host.py)


def default_config(rows_per_expert: int, n: int, k: int, fp8: bool) -> TileConfig:
    """A reasonable tile when no tuned entry exists (interpreter: few, wide tiles), never wider
    than N (session 49: the NVFP4 experts' GEMMs, which run untuned tiles, met N = 64)."""
    if interpreting():
        bk = 32 if k % 64 else 64
        cfg = TileConfig(16, 64, bk, 1, 4, 1)
    else:
        bk = 128 if fp8 or k % 128 == 0 else 64
        if rows_per_expert <= 16:
            cfg = TileConfig(16, 64, bk, 1, 4, 4)
        elif rows_per_expert <= 64:
            cfg = TileConfig(64, 64, 64 if not fp8 else 128, 8, 4, 4)
        else:
            cfg = TileConfig(128, 128, 64 if not fp8 else 128, 8, 8, 3)
    return replace(cfg, block_n=min(cfg.block_n, max(16, next_power_of_2(n))))


@triton.jit
def _expert_tile(
    pid,
    masked_m_ptr,
    num_m_tiles,
    N,
    E: tl.constexpr,
    E_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Program pid -> (expert, rows offs_m, row mask, M tile, N tile). The expert is >= E past
    the last live tile (the grid is a bound): such programs have nothing to do."""
    pid_m, pid_n = _grouped_tile(pid, num_m_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    e, offs_m, m_mask = masked_row_tile(pid_m, masked_m_ptr, E, E_P, BLOCK_M)
    return e, offs_m, m_mask, pid_m, pid_n


@triton.jit
def _dot_k(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    e64,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    n_second,
    stride_ae,
    stride_am,
    stride_ak,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    DUAL: tl.constexpr,
):
    """fp32 a[e, offs_m, :] @ w[e, offs_n, :]^T, and with DUAL the same for weight rows
    offs_n + n_second (a gated layer's up half) in the same K loop, sharing the A tile. FP8:
    each K tile's product scaled by its activation group's and weight block's scales."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + e64 * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + e64 * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        as_ptrs = a_scale_ptr + e64 * stride_ase + offs_m * stride_asm
        bs_ptrs = b_scale_ptr + e64 * stride_bse + (offs_n // 128) * stride_bsn
        bs2_ptrs = b_scale_ptr + e64 * stride_bse + ((offs_n + n_second) // 128) * stride_bsn
    for kb in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        if DUAL:
            b2 = tl.load(b_ptrs + n_second * stride_bn, mask=n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if DUAL:
                b2 = b2.to(tl.float32)
        if FP8:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=m_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            if DUAL:  # the up half's rows offs_n + n_second: their own 128-row scale blocks
                b2_s = tl.load(bs2_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
                acc2 += tl.dot(a, b2) * a_s[:, None] * b2_s[None, :]
        else:
            acc += tl.dot(a, b)
            if DUAL:
                acc2 += tl.dot(a, b2)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, acc2


@triton.jit
def _gemm1_act(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    e64,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    stride_ae,
    stride_am,
    stride_ak,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_bias_e,
    alpha,
    limit,
    out_scale_ptr,
    mid_ty: tl.constexpr,
    I_SIZE: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HAS_OUT_SCALE: tl.constexpr,
):
    """GEMM1 of expert e64 on the A rows offs_m (gate and up halves in one K loop when gated),
    plus the bias, then the activation: fp32 [BLOCK_M, BLOCK_N]. As the unfused path: the GEMM1
    output (x the expert's fp32 factor `out_scale_ptr[e]` with HAS_OUT_SCALE, + bias) rounded to
    `mid_ty` (the layer dtype), the activation in fp32. FP8: fp8 operands with their block
    scales (the scale arguments are unused otherwise). Shared by the fused masked kernel and the
    token-major one (`moehal.kernels.triton_token_moe`)."""
    g, u = _dot_k(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, e64, offs_m, m_mask, offs_n, n_mask, I_SIZE,
        stride_ae, stride_am, stride_ak, stride_ase, stride_asm, stride_ask,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
        K, BLOCK_M, BLOCK_N, BLOCK_K, FP8, UPCAST, GATED,
    )  # fmt: skip
    if HAS_OUT_SCALE:  # NVFP4's global scales (`moehal_cuda.nvfp4_dequant`), before the rounding
        factor = tl.load(out_scale_ptr + e64)
        g = g * factor
        u = u * factor
    if HAS_BIAS:
        brow = bias_ptr + e64 * stride_bias_e
        g += tl.load(brow + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            u += tl.load(brow + I_SIZE + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    g = _to(g, mid_ty, EXACT_ROUND).to(tl.float32)
    u = _to(u, mid_ty, EXACT_ROUND).to(tl.float32)
    return _activation(g, u, alpha, limit, ACT, GATED)


@fast_launch
@triton.jit(do_not_specialize=["num_m_tiles", "num_rows"])
def _masked_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    masked_m_ptr,
    num_m_tiles,
    stride_ae,
    stride_am,
    stride_ak,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_ce,
    stride_cm,
    stride_cn,
    scale_ptr,
    num_rows,
    bias_ptr,
    stride_bias_e,
    E: tl.constexpr,
    E_P: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CONTIG: tl.constexpr,
):
    # CONTIG: one [M, K] buffer of expert segments aligned to BLOCK_M rows, `masked_m_ptr` is
    # each row's expert (-1: padding), tile t holds rows [t * BLOCK_M, +BLOCK_M) of one segment.
    # The tile's first row moves the row pointers in int64 (row x K passes 2^31 from 262144 rows
    # at K = 8192), and the tile indexes its own rows from 0 in int32, as the masked tiles do.
    if CONTIG:
        pid_m, pid_n = _grouped_tile(tl.program_id(0), num_m_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
        row0 = pid_m.to(tl.int64) * BLOCK_M
        offs_m = tl.arange(0, BLOCK_M)
        row_e = tl.load(masked_m_ptr + row0 + offs_m, mask=row0 + offs_m < num_rows, other=-1)
        e = tl.max(tl.where(offs_m == 0, row_e, -1), axis=0)  # the tile's first row's
        m_mask = row_e == e
        if e < 0:
            return
        a_ptr += row0 * stride_am
        a_scale_ptr += row0 * stride_asm
        c_ptr += row0 * stride_cm
    else:
        e, offs_m, m_mask, _, pid_n = _expert_tile(
            tl.program_id(0), masked_m_ptr, num_m_tiles, N, E, E_P, BLOCK_M, BLOCK_N, GROUP_M
        )
        if e >= E:
            return
    e64 = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc, _ = _dot_k(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, e64, offs_m, m_mask, offs_n, n_mask, 0,
        stride_ae, stride_am, stride_ak, stride_ase, stride_asm, stride_ask,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
        K, BLOCK_M, BLOCK_N, BLOCK_K, FP8, UPCAST, False,
    )  # fmt: skip
    if HAS_SCALE:  # one fp32 factor per expert, applied before the output's single rounding
        acc = acc * tl.load(scale_ptr + e64)
    if HAS_BIAS:  # fp32 [E, N], added before it too (the reference's h = x @ w^T + b, then rounded)
        acc = acc + tl.load(bias_ptr + e64 * stride_bias_e + offs_n, mask=n_mask, other=0.0)[None, :]
    c_ptrs = c_ptr + e64 * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, _to(acc, c_ptr.dtype.element_ty, UPCAST), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _store_fp8_groups(
    v,
    out_rows,
    scale_rows,
    stride_sg,
    static_ptr,
    cols,
    g0,
    m_mask,
    I_SIZE,
    R: tl.constexpr,
    G: tl.constexpr,
    UE8M0: tl.constexpr,
    STATIC: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    """fp32 `v [R, G*128]` (columns `cols`: groups g0 .. g0+G-1) -> e4m3 at `out_rows + cols`
    and a scale per row and group at `scale_rows + group * stride_sg`: each group's own
    (`e4m3_groups_quant`), or the static one in every group's slot; rows in `m_mask` and
    columns below I_SIZE only."""
    if STATIC:
        sc1 = tl.load(static_ptr)
        q = e4m3_static_quant(v, sc1, EXACT_ROUND)
        sc = tl.zeros((R, G), dtype=tl.float32) + sc1
    else:
        q, sc = e4m3_groups_quant(v, R, G, UE8M0, EXACT_ROUND)
    tl.store(out_rows + cols[None, :], q.to(out_rows.dtype.element_ty), mask=m_mask[:, None] & (cols < I_SIZE)[None, :])
    grp = g0 + tl.arange(0, G)
    tl.store(scale_rows + grp[None, :] * stride_sg, sc, mask=m_mask[:, None] & (grp * 128 < I_SIZE)[None, :])


@fast_launch
@triton.jit(do_not_specialize=["num_m_tiles"])
def _masked_gemm_act_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    stride_bias_e,
    out_ptr,
    out_scale_ptr,
    static_ptr,
    stage_ptr,
    count_ptr,
    y_ptr,
    masked_m_ptr,
    state_ptr,
    num_m_tiles,
    stride_ae,
    stride_am,
    stride_ak,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_oe,
    stride_om,
    stride_ose,
    stride_osm,
    stride_osg,
    stride_ye,
    stride_ym,
    alpha,
    limit,
    H,
    E: tl.constexpr,
    E_P: tl.constexpr,
    I_SIZE: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    UE8M0: tl.constexpr,
    STATIC: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    n_gemm = num_m_tiles * tl.cdiv(I_SIZE, BLOCK_N)
    if pid >= n_gemm:
        # stale rows of the activation and GEMM2 output buffers: [count now, count before)
        sp = pid - n_gemm
        ex = sp // N_SPLIT
        cnt = tl.load(masked_m_ptr + ex)
        before = tl.load(state_ptr + ex)
        e_off = ex.to(tl.int64)
        part = sp % N_SPLIT
        zero_stale_rows(out_ptr + e_off * stride_oe, stride_om, 0, I_SIZE, cnt, before, part, N_SPLIT, 16, 128)
        zero_stale_rows(y_ptr + e_off * stride_ye, stride_ym, 0, H, cnt, before, part, N_SPLIT, 16, 256)
        publish_rows(state_ptr, ex, cnt, E, N_SPLIT)
        return
    e, offs_m, m_mask, pid_m, pid_n = _expert_tile(
        pid, masked_m_ptr, num_m_tiles, I_SIZE, E, E_P, BLOCK_M, BLOCK_N, GROUP_M
    )
    if e >= E:
        return
    e64 = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I_SIZE
    mid_ty = y_ptr.dtype.element_ty  # the layer dtype: GEMM1's output and the activation round to it
    a = _gemm1_act(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, e64, offs_m, m_mask, offs_n, n_mask,
        stride_ae, stride_am, stride_ak, stride_ase, stride_asm, stride_ask,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk, stride_bias_e, alpha, limit,
        bias_ptr, mid_ty, I_SIZE, K, BLOCK_M, BLOCK_N, BLOCK_K, ACT, GATED, HAS_BIAS, FP8, UPCAST, EXACT_ROUND,
        False,
    )  # fmt: skip
    live = m_mask[:, None] & n_mask[None, :]
    o_rows = out_ptr + e64 * stride_oe + offs_m[:, None] * stride_om
    if FP8:
        # GEMM2's fp8 input, as the unfused activation kernel writes it (`moehal_cuda.triton_glue`):
        # the activation rounded to the layer dtype, then 1x128 groups (BLOCK_N // 128 per tile)
        # with scales of their own, or the static scale in every group's slot
        a = tl.where(live, _to(a, mid_ty, EXACT_ROUND).to(tl.float32), 0.0)
        s_rows = out_scale_ptr + e64 * stride_ose + offs_m[:, None] * stride_osm
        if SPLIT > 1:
            # N tiles narrower than a group (decode: more programs streaming weights): the SPLIT
            # programs of one group stage their slices (exact: already on the layer dtype's grid)
            # and count in; the last to arrive reads the group back and quantizes it. A CTA
            # barrier, then a gpu-scope acq_rel atomic by one thread (CUTLASS's semaphore):
            # the slices are visible to the last program, which re-arms the counter.
            g0 = (pid_n * BLOCK_N) // 128
            st_rows = stage_ptr + (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * I_SIZE
            tl.store(st_rows + offs_n[None, :], a.to(mid_ty), mask=live)
            tl.debug_barrier()
            cnt = count_ptr + pid_m * (I_SIZE // 128) + g0
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
                cols = g0 * 128 + tl.arange(0, 128)
                v = tl.load(st_rows + cols[None, :], mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
                v = v.to(tl.float32)
                _store_fp8_groups(
                    v, o_rows, s_rows, stride_osg, static_ptr, cols, g0, m_mask, I_SIZE, BLOCK_M, 1, UE8M0, STATIC,
                    EXACT_ROUND,
                )  # fmt: skip
        else:
            _store_fp8_groups(
                a, o_rows, s_rows, stride_osg, static_ptr, offs_n, pid_n * (BLOCK_N // 128), m_mask, I_SIZE,
                BLOCK_M, BLOCK_N // 128, UE8M0, STATIC, EXACT_ROUND,
            )  # fmt: skip
    else:
        tl.store(o_rows + offs_n[None, :], _to(a, out_ptr.dtype.element_ty, EXACT_ROUND), mask=live)


def num_m_tiles(total_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on the live M tiles: each non-empty expert wastes at most one partial tile,
    and at most min(E, S) experts are non-empty."""
    s = max(int(total_rows), 0)
    return cdiv(s, block_m) + min(num_experts, s)


def masked_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    masked_m: torch.Tensor,
    total_rows: int,
    config: TileConfig | None = None,
    out_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[e, :masked_m[e]] = a[e, :masked_m[e]] @ w[e]^T (x out_scale[e]) (+ bias[e]); other
    rows of `out` untouched. (Arguments: `bind_masked_grouped_gemm`, which this binds and calls
    in one go.)"""
    launch = bind_masked_grouped_gemm(a, a_scale, w, w_scale, out, total_rows, config, out_scale, bias)
    return out if launch is None else launch(a, a_scale, out, masked_m)


# The masked kernels offset within one expert's [max_m, cols] slice in int32 (only the expert's
# own offset is int64, to keep the tile's pointer arithmetic 32-bit): a slice past this many
# elements would wrap (max_m about 300k rows at hidden size 7168). Binding refuses it.
INT32_SPAN = 2**31 - 1


def check_expert_spans(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the first `[E, rows, ...]` tensor one of whose expert slices spans
    more elements than the masked kernels' int32 offsets reach (`INT32_SPAN`)."""
    for name, t in tensors.items():
        if t is None or t.dim() < 2 or t.numel() == 0:
            continue
        span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[1:], t.stride()[1:]))
        if span > INT32_SPAN:
            raise ValueError(
                f"{name} {tuple(t.shape)}: one expert's slice spans {span} elements, past the masked "
                f"kernels' int32 offsets ({INT32_SPAN}); build the layer for fewer tokens per expert"
            )


def bind_masked_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    total_rows: int,
    config: TileConfig | None = None,
    out_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> MaskedGemmLaunch | None:
    """Check `masked_grouped_gemm`'s arguments and choose its tile: its launch for these shapes,
    this total-rows bound and these weights (None: nothing to compute), to call as
    `launch(a, a_scale, out, masked_m)` with tensors of the same shapes (`launch.takes`).

    a `[E, max_m, K]` bf16/fp16, or fp8 e4m3 with `a_scale` fp32 `[E, max_m, K/128]` (any
    strides; MN-major as DeepGEMM takes them is fine); w `[E, N, K]` (K-major) in a's dtype,
    fp8 with `w_scale` fp32 `[E, N/128, K/128]`; out `[E, max_m, N]`; masked_m int32 `[E]`.
    total_rows: host int >= sum(masked_m) (sizes the grid; never read from the device).
    out_scale: fp32 `[E]`, each expert's output multiplied by its factor before the output's
    one rounding (NVFP4's global scales, `moehal_cuda.nvfp4_dequant`).
    bias: fp32 `[E, N]`, added to each expert's rows after the factor, before that rounding.
    No host synchronization: CUDA-graph capturable.
    """
    e, max_m, k = a.shape
    n = w.shape[1]
    fp8 = a_scale is not None
    if w.shape[0] != e or w.shape[2] != k or tuple(out.shape) != (e, max_m, n):
        raise ValueError(f"shapes do not match: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if fp8 and w_scale is None:
        raise ValueError("fp8 activations need weight scales")
    check_expert_spans(a=a, a_scale=a_scale, w=w, w_scale=w_scale, out=out)
    cfg = config or default_config(max(1, total_rows // max(e, 1)), n, k, fp8)
    if not cfg.fits(n, k, fp8):
        raise ValueError(f"tile {cfg} does not fit N={n}, K={k} (K tiles must divide K)")
    tiles_m = num_m_tiles(min(total_rows, e * max_m), e, cfg.block_m)
    if tiles_m == 0 or n == 0:
        return None
    _check_out_scale(out_scale, e)
    _check_bias(bias, e, n)
    sw = w_scale if fp8 else None
    return MaskedGemmLaunch(
        a.shape, out.shape, (tiles_m * cdiv(n, cfg.block_n),), tiles_m, w, sw,
        (*w.stride(), *(sw.stride() if sw is not None else (0, 0, 0))),
        dict(
            E=e, E_P=max(16, next_power_of_2(e)), N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FP8=fp8, UPCAST=INTERPRETED,
            HAS_SCALE=out_scale is not None, HAS_BIAS=bias is not None, CONTIG=False, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ),
        out_scale,
        bias,
    )  # fmt: skip


def _check_out_scale(out_scale: torch.Tensor | None, e: int) -> None:
    if out_scale is not None and (out_scale.dtype != torch.float32 or tuple(out_scale.shape) != (e,)):
        raise ValueError(
            f"out_scale must be fp32 [{e}] (one factor per expert), got {out_scale.dtype} {tuple(out_scale.shape)}"
        )


def _check_bias(bias: torch.Tensor | None, e: int, n: int) -> None:
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (e, n) or bias.stride(1) != 1):
        raise ValueError(
            f"bias must be fp32 [{e}, {n}] with contiguous rows, got {bias.dtype} {tuple(bias.shape)} "
            f"strides {bias.stride()}"
        )


def contiguous_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    row_expert: torch.Tensor,
    alignment: int,
    out_scale: torch.Tensor | None = None,
    config: TileConfig | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[r] = a[r] @ w[row_expert[r]]^T (x out_scale[row_expert[r]]) (+ bias[row_expert[r]])
    for every row r whose expert is >= 0, rounded once; padding rows (-1) of `out` untouched.
    The contiguous layout's counterpart of `masked_grouped_gemm` (DeepGEMM's
    `m_grouped_*_gemm_nt_contiguous`), bf16/fp16 only.

    a `[M, K]`, w `[E, N, K]` (K-major) in a's dtype, out `[M, N]`, row_expert int32 `[M]`;
    each expert's segment starts at a multiple of `alignment` rows (DeepGEMM's: 128), which
    bounds the tile's rows: a tile holds rows of one segment. No host synchronization:
    CUDA-graph capturable.
    """
    m, k = a.shape
    e, n = w.shape[0], w.shape[1]
    if w.shape[2] != k or tuple(out.shape) != (m, n) or tuple(row_expert.shape) != (m,):
        raise ValueError(
            f"shapes do not match: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}, "
            f"row_expert {tuple(row_expert.shape)}"
        )
    _check_out_scale(out_scale, e)
    _check_bias(bias, e, n)
    cfg = config or default_config(max(1, m // max(e, 1)), n, k, False)
    if alignment < 16 or alignment & (alignment - 1):
        raise ValueError(f"contiguous segments aligned to {alignment} rows: tiles need a power of two >= 16")
    if cfg.block_m > alignment:
        cfg = replace(cfg, block_m=alignment)
    if not cfg.fits(n, k, False):
        raise ValueError(f"tile {cfg} does not fit N={n}, K={k} (K tiles must divide K)")
    tiles_m = cdiv(m, cfg.block_m)
    if tiles_m == 0 or n == 0:
        return out
    _masked_gemm_kernel[(tiles_m * cdiv(n, cfg.block_n),)](
        a, out, w, out, out, row_expert, tiles_m, 0, *a.stride(), 0, 0, 0, *w.stride(), 0, 0, 0,
        0, *out.stride(), out_scale if out_scale is not None else out, m,
        bias if bias is not None else out, bias.stride(0) if bias is not None else 0,
        E=e, E_P=max(16, next_power_of_2(e)), N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FP8=False, UPCAST=INTERPRETED,
        HAS_SCALE=out_scale is not None, HAS_BIAS=bias is not None, CONTIG=True, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class MaskedGemmLaunch:
    """`_masked_gemm_kernel`'s launch for one input shape, one total-rows bound and one weight
    tensor (`bind_masked_grouped_gemm`): all but the call's activations, their scales, the
    output and masked_m fixed. Why: at a decode step the checks, the tile rules and the
    argument list cost an eager forward more host time than the launch itself."""

    shape: torch.Size  # a's [E, max_m, K]
    out_shape: torch.Size  # [E, max_m, N]
    grid: tuple[int]
    tiles_m: int
    w: torch.Tensor
    w_scale: torch.Tensor | None  # fp8 weights' scales; None: bf16/fp16
    w_strides: tuple[int, ...]  # w's and w_scale's (zeros without scales)
    kw: dict
    out_scale: torch.Tensor | None = None  # fp32 [E]: each expert's output factor
    bias: torch.Tensor | None = None  # fp32 [E, N], added after the factor

    def takes(self, a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether this launch computes `a @ w^T` into `out` (else bind again: the checks run)."""
        return (
            w is self.w and a.shape == self.shape and out.shape == self.out_shape
            and (a_scale is None) == (self.w_scale is None)
        )  # fmt: skip

    def __call__(
        self, a: torch.Tensor, a_scale: torch.Tensor | None, out: torch.Tensor, masked_m: torch.Tensor
    ) -> torch.Tensor:
        if self.w_scale is not None:
            assert a_scale is not None
            sa, sw, sa_strides = a_scale, self.w_scale, a_scale.stride()
        else:
            sa, sw, sa_strides = out, out, (0, 0, 0)
        scale = self.out_scale if self.out_scale is not None else out
        bias, bias_stride = (self.bias, self.bias.stride(0)) if self.bias is not None else (out, 0)
        self._site(
            a, sa, self.w, sw, out, masked_m, self.tiles_m, *a.stride(), *sa_strides, *self.w_strides, *out.stride(),
            scale, 0, bias, bias_stride,
        )  # fmt: skip
        return out

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_masked_gemm_kernel, self.grid, **self.kw)


# Shared memory a pipelined tile may use (H100/H200 allow 227 KiB per block; leave headroom
# for the epilogue's scratch).
SMEM_BUDGET = 200 * 1024


def smem_bytes(config: TileConfig, elem_bytes: int, b_tiles: int = 1) -> int:
    """Shared memory of the K pipeline: num_stages buffers of the A tile and `b_tiles` B tiles."""
    return config.num_stages * (config.block_m + b_tiles * config.block_n) * config.block_k * elem_bytes


@functools.cache  # called on every fused forward: the answer per (tile, K) never changes
def fused_act_config(config: TileConfig, k: int, elem_bytes: int = 2, quant: bool = False) -> TileConfig:
    """A GEMM1 tile tuned for the plain kernel, adapted to the fused one, which keeps a gate and
    an up B tile per stage: a shorter K tile first (down to 64; the stages, so the bytes in
    flight, stay), then fewer stages, until the pipeline fits `SMEM_BUDGET` (a tuned 16x64x256,
    5-stage tile needs 368 KiB fused and failed to launch on an H100).

    `quant` (an fp8 activation output): an N tile must hold whole 1x128 groups or a whole
    fraction of one (its programs then meet to quantize the group), so one wider than 128
    columns is widened to whole groups first."""
    c = config
    if quant and c.block_n % FP8_GROUP and FP8_GROUP % c.block_n:
        c = replace(c, block_n=cdiv(c.block_n, FP8_GROUP) * FP8_GROUP)
    while smem_bytes(c, elem_bytes, 2) > SMEM_BUDGET and c.block_k > 64 and k % (c.block_k // 2) == 0:
        c = replace(c, block_k=c.block_k // 2)
    while smem_bytes(c, elem_bytes, 2) > SMEM_BUDGET and c.num_stages > 1:
        c = replace(c, num_stages=c.num_stages - 1)
    return c


def masked_gemm_act(
    a: torch.Tensor,
    w13: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    y: torch.Tensor,
    masked_m: torch.Tensor,
    total_rows: int,
    config: TileConfig,
    *,
    activation: int,
    gated: bool,
    alpha: float = 0.0,
    limit: float = 0.0,
    fp8: Fp8Operands | None = None,
) -> torch.Tensor:
    """GEMM1 and the activation in one kernel (the masked layout):

        out[e, m, :] = act(a[e, m] @ w13[e]^T + bias[e])      for m < masked_m[e]

    bf16/fp16 operands, or with `fp8` FP8 block-scale ones and an fp8 output quantized in 1x128
    groups, as `moehal_cuda.triton_glue.activation` quantizes GEMM2's input.
    (Arguments: `bind_masked_gemm_act`, which this binds and calls in one go.)"""
    launch = bind_masked_gemm_act(
        a, w13, bias, out, out_rows, y, total_rows, config, activation=activation, gated=gated, alpha=alpha,
        limit=limit, fp8=fp8,
    )  # fmt: skip
    return launch(a, out, out_rows, y, masked_m, fp8.a_scale if fp8 else None, fp8.out_scale if fp8 else None)


@dataclass(frozen=True)
class Fp8Operands:
    """The FP8 side of `bind_masked_gemm_act`: scales of its operands and of its output."""

    a_scale: torch.Tensor  # fp32 [E, max_m, K/128], any strides (MN-major, as DeepGEMM takes them)
    w13_scale: torch.Tensor  # fp32 [E, N13/128, K/128]
    out_scale: torch.Tensor  # fp32 [E, max_m, I/128], any strides: the output's group scales
    ue8m0: bool = False  # the output's group scales rounded up to powers of two
    static_scale: torch.Tensor | None = None  # fp32 [1]: quantize the output with it (fp8_tensor)


def bind_masked_gemm_act(
    a: torch.Tensor,
    w13: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    y: torch.Tensor,
    total_rows: int,
    config: TileConfig,
    *,
    activation: int,
    gated: bool,
    alpha: float = 0.0,
    limit: float = 0.0,
    fp8: Fp8Operands | None = None,
) -> MaskedGemmActLaunch:
    """Check `masked_gemm_act`'s arguments and adapt its tile: its launch for these shapes, this
    total-rows bound and these weights, to call as
    `launch(a, out, out_rows, y, masked_m, a_scale, out_scale)` with tensors of the same shapes
    (`launch.takes`; the scales only with `fp8`).

    a `[E, max_m, K]`; w13 `[E, N13, K]` with N13 = 2 * I ([gate; up]) when gated, else I;
    bias `[E, N13]` or None; out `[E, max_m, I]`, in a's dtype (bf16/fp16), or float8_e4m3fn
    with `fp8` (a and w13 then float8_e4m3fn, I a multiple of 128); y `[E, max_m, H]` in the
    layer dtype, which GEMM1's output and the activation are rounded to, as the unfused path
    stores them. `activation`: the `moehal.kernels.triton_fused_moe` ids (1 silu, 2 gelu,
    3 swiglu_oai with alpha/limit).

    Like `moehal_cuda.triton_glue.activation`, it keeps the padding of `out` and of the GEMM2
    output `y [E, max_m, H]` zero: rows live in the previous call and not now are zeroed, from
    `out_rows` (int32 [2, E], the per-expert record of `moehal.kernels.triton_permute`). No
    host synchronization; total_rows is a host bound on sum(masked_m) that sizes the grid.
    """
    e, max_m, k = a.shape
    i = out.shape[-1]
    n13 = w13.shape[1]
    if n13 != (2 * i if gated else i) or w13.shape[0] != e or w13.shape[2] != k or tuple(out.shape[:2]) != (e, max_m):
        raise ValueError(f"shapes do not match: a {tuple(a.shape)}, w13 {tuple(w13.shape)}, out {tuple(out.shape)}")
    if fp8 is None:
        if a.dtype != w13.dtype or a.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the fused GEMM1 takes bf16/fp16 operands of one dtype, got {a.dtype} and {w13.dtype}")
    else:
        fp8_dt = torch.float8_e4m3fn
        if a.dtype != fp8_dt or w13.dtype != fp8_dt or out.dtype != fp8_dt:
            raise ValueError(f"fp8 fused GEMM1 takes e4m3 operands and output, got {a.dtype}, {w13.dtype}, {out.dtype}")
        if i % FP8_GROUP or k % FP8_GROUP:
            raise ValueError(f"fp8 fused GEMM1 needs I and K in whole 128-wide groups, got I={i}, K={k}")
        if tuple(fp8.w13_scale.shape) != (e, n13 // FP8_GROUP, k // FP8_GROUP):
            raise ValueError(f"w13_scale must be [E, N13/128, K/128], got {tuple(fp8.w13_scale.shape)}")
        if tuple(fp8.out_scale.shape) != (e, max_m, i // FP8_GROUP):
            raise ValueError(f"out_scale must be [E, max_m, I/128], got {tuple(fp8.out_scale.shape)}")
        static = fp8.static_scale
        if static is not None and (fp8.ue8m0 or static.numel() != 1):
            raise ValueError("static_scale quantizes the output with fp32 group scales, one scale value")
    if out.stride(-1) != 1 or tuple(out_rows.shape) != (2, e):
        raise ValueError("out must be row-contiguous and out_rows int32 [2, E]")
    scales = (fp8.a_scale, fp8.w13_scale, fp8.out_scale) if fp8 is not None else (None, None, None)
    check_expert_spans(a=a, w13=w13, out=out, y=y, a_scale=scales[0], w13_scale=scales[1], out_scale=scales[2])
    config = fused_act_config(config, k, a.element_size(), quant=fp8 is not None)
    if not config.fits(i, k, fp8 is not None):
        raise ValueError(f"tile {config} does not fit N={i}, K={k}")
    tiles_m = num_m_tiles(min(total_rows, e * max_m), e, config.block_m)
    n_split = stale_splits(max_m, 16, e)
    b = bias if bias is not None else w13
    sw = fp8.w13_scale if fp8 is not None else w13
    static_arg = fp8.static_scale if fp8 is not None and fp8.static_scale is not None else sw
    # fp8 with N tiles narrower than a group: each group's programs stage their slices of the
    # activation in the layer dtype, per M tile of this launch, and count their arrivals there
    split = FP8_GROUP // config.block_n if fp8 is not None and config.block_n < FP8_GROUP else 1
    stage, counts = sw, sw
    if split > 1:  # process-wide (a CUDA graph may capture them), as the decode paths' scratch
        stage = scratch("gemm1_act.stage", (max(tiles_m, 1) * config.block_m, i), y.dtype, a.device)
        counts = arrivals(max(tiles_m, 1) * (i // FP8_GROUP), a.device)
    return MaskedGemmActLaunch(
        a.shape, out.shape, y.shape, (tiles_m * cdiv(i, config.block_n) + e * n_split,), tiles_m, w13, bias,
        fp8.w13_scale if fp8 is not None else None, fp8.static_scale if fp8 is not None else None,
        (b, b.stride(0) if bias is not None else 0), (*w13.stride(), *(sw.stride() if fp8 is not None else (0, 0, 0))),
        (sw, static_arg, stage, counts), (float(alpha), float(limit), y.shape[-1]),
        dict(
            E=e, E_P=max(16, next_power_of_2(e)), I_SIZE=i, K=k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, GROUP_M=config.group_m, ACT=activation, GATED=gated,
            HAS_BIAS=bias is not None, N_SPLIT=n_split, FP8=fp8 is not None,
            UE8M0=fp8 is not None and fp8.ue8m0, STATIC=fp8 is not None and fp8.static_scale is not None,
            SPLIT=split, UPCAST=INTERPRETED, EXACT_ROUND=INTERPRETED, num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class MaskedGemmActLaunch:
    """`_masked_gemm_act_kernel`'s launch for one input shape, one total-rows bound and one
    layer's GEMM1 weights (`bind_masked_gemm_act`): all but the call's activations (and their
    scales), the two output buffers (and the activation's scales), their row record and masked_m
    fixed (host time, as `MaskedGemmLaunch`)."""

    shape: torch.Size  # a's [E, max_m, K]
    out_shape: torch.Size  # [E, max_m, I]
    y_shape: torch.Size  # [E, max_m, H]
    grid: tuple[int]
    tiles_m: int
    w13: torch.Tensor
    bias: torch.Tensor | None
    w13_scale: torch.Tensor | None  # fp8: the weights' block scales; None: bf16/fp16
    static_scale: torch.Tensor | None  # fp8_tensor: the output's static scale
    bias_args: tuple  # bias (or w13), its expert stride
    w_strides: tuple[int, ...]  # w13's and w13_scale's (zeros without scales)
    # w13_scale (or w13: unused), static_scale (or any tensor: unused), and where an N tile is
    # narrower than a group, the staged activation and the groups' arrival counters (else unused)
    fp8_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    tail: tuple  # alpha, limit, H
    kw: dict

    def takes(self, a: torch.Tensor, w13: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              y: torch.Tensor, w13_scale: torch.Tensor | None = None,
              static_scale: torch.Tensor | None = None) -> bool:  # fmt: skip
        """Whether this launch computes these operands (else bind again: the checks run)."""
        return (
            w13 is self.w13 and bias is self.bias and w13_scale is self.w13_scale and static_scale is self.static_scale
            and a.shape == self.shape and out.shape == self.out_shape and y.shape == self.y_shape
            and out.stride(-1) == 1
        )  # fmt: skip

    def __call__(
        self,
        a: torch.Tensor,
        out: torch.Tensor,
        out_rows: torch.Tensor,
        y: torch.Tensor,
        masked_m: torch.Tensor,
        a_scale: torch.Tensor | None = None,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`a_scale` and `out_scale` (fp8 launches only): of the shapes `Fp8Operands` gives."""
        s_oe, s_om, _ = out.stride()
        s_ye, s_ym, _ = y.stride()
        if self.w13_scale is not None:
            assert a_scale is not None and out_scale is not None, "an fp8 launch takes a_scale and out_scale"
            sa, so = a_scale, out_scale
            sa_strides, so_strides = a_scale.stride(), out_scale.stride()
        else:
            sa = so = out
            sa_strides, so_strides = (0, 0, 0), (0, 0, 0)
        self._site(
            a, sa, self.w13, self.fp8_args[0], *self.bias_args, out, so, *self.fp8_args[1:], y, masked_m, out_rows,
            self.tiles_m, *a.stride(), *sa_strides, *self.w_strides, s_oe, s_om, *so_strides, s_ye, s_ym,
            *self.tail,
        )  # fmt: skip
        return out

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_masked_gemm_act_kernel, self.grid, **self.kw)
