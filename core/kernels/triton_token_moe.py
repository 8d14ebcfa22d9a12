# Triton reads annotations of @triton.jit parameters, so the kernels' parameters stay untyped:
# ruff: noqa: ANN001, ANN202
"""The whole MoE layer in two Triton kernels for a few tokens (decode), token-major in and out.

    token_gemm_act       act[s, :] = act(x[s // K] @ w13[ids[s]]^T + b13)       s = t * K + k
    token_gemm_combine   out[t, :] = scaling * sum_k w[t, k] * (act[t*K+k] @ w2[ids[t, k]]^T + b2)

Why: at one token every expert gets one row, so grouping rows by expert (a permute kernel
before the GEMMs, a gather-and-sum after them) saves no weight traffic and costs two launches
and two rounds of memory latency (~6 us of a 40 us Qwen3-30B-A3B decode step on an H100;
docs/device-runs/2026-11-23-session5, section 7). Here GEMM1 reads its token's row directly
and GEMM2 sums the top-k rows of a token in registers, in a fixed order (deterministic, no
atomics). A program still computes a 16-row tile (`tl.dot`'s minimum) of which one row is
live, as the masked GEMM does at one row per expert: decode is bound by weight bandwidth.

Ids are the STANDARD layout's local expert ids (int32 or int64, -1 = expert not on this
rank: the slot contributes nothing). Rounding follows the modular path: the GEMM1 output (+
bias) and each GEMM2 row (+ bias) are rounded to the layer dtype before the activation and
the weighted fp32 sum, as the reference oracle does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from moehal.kernels.host import cdiv, interpreting, kernel_modules_interpreted, next_power_of_2
from moehal.kernels.launch import Site, fast_launch, site
from moehal.kernels.tiles import TileConfig
from moehal.kernels.triton_fused_moe import _to
from moehal.kernels.triton_grouped_gemm import _gemm1_act, fused_act_config
from moehal.kernels.triton_nvfp4 import nvfp4_qdq
from moehal.kernels.triton_permute import arrivals, scratch

INTERPRETED = kernel_modules_interpreted()  # as triton.jit decorates this module's kernels (host.py)

# One live row per program; 16 is the smallest M tile `tl.dot` takes.
_BLOCK_M = 16


# the token count is a plain argument (one compile serves every decode size a graph captures)
@fast_launch
@triton.jit(do_not_specialize=["num_slots"])
def _token_gemm_act_kernel(
    x_ptr,
    stride_xt,
    ids_ptr,
    b_ptr,
    bias_ptr,
    stride_bias_e,
    out_ptr,
    stride_os,
    stride_be,
    stride_bn,
    stride_bk,
    alpha,
    limit,
    num_slots,
    scale_ptr,
    act_gs_ptr,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    I_SIZE: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NVFP4: tl.constexpr,
):
    # N-tile-major order: the programs running together read one N tile of every slot's
    # expert, so slots that share an expert share that tile in L2
    pid = tl.program_id(0)
    s = pid % num_slots
    e = tl.load(ids_ptr + s).to(tl.int32)
    if (e < 0) | (e >= E):
        return  # not a local expert: token_gemm_combine skips this slot
    e64 = e.to(tl.int64)
    t = (s // TOP_K).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < 1  # the token's row, broadcast over the tile (stride 0), live in row 0
    offs_n = (pid // num_slots) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I_SIZE
    a = _gemm1_act(
        x_ptr + t * stride_xt, x_ptr, b_ptr, b_ptr, bias_ptr, e64, offs_m, m_mask, offs_n, n_mask,
        0, 0, 1, 0, 0, 0, stride_be, stride_bn, stride_bk, 0, 0, 0, stride_bias_e, alpha, limit, scale_ptr,
        out_ptr.dtype.element_ty, I_SIZE, K, BLOCK_M, BLOCK_N, BLOCK_K, ACT, GATED, HAS_BIAS, False, UPCAST,
        EXACT_ROUND, HAS_SCALE,
    )  # fmt: skip
    a = _to(a, out_ptr.dtype.element_ty, EXACT_ROUND)
    if NVFP4:  # GEMM2's input as NVFP4 block values: the tile's 16-column groups are whole
        a = nvfp4_qdq(a.to(tl.float32), tl.load(act_gs_ptr).to(tl.float32), BLOCK_M, BLOCK_N, EXACT_ROUND)
        a = a.to(out_ptr.dtype.element_ty)  # exact in bf16
    o_ptrs = out_ptr + s.to(tl.int64) * stride_os + offs_m[:, None] * 0 + offs_n[None, :]
    tl.store(o_ptrs, a, mask=m_mask[:, None] & n_mask[None, :])


@fast_launch
@triton.jit(do_not_specialize=["num_tokens"])
def _token_gemm_combine_kernel(
    act_ptr,
    stride_as,
    ids_ptr,
    w_ptr,
    b_ptr,
    bias_ptr,
    stride_bias_e,
    out_ptr,
    stride_ot,
    partial_ptr,
    arrivals_ptr,
    stride_be,
    stride_bn,
    stride_bk,
    scaling,
    num_tokens,
    scale_ptr,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    K_P: tl.constexpr,
    SPLIT: tl.constexpr,
    N: tl.constexpr,
    I_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_WEIGHTS: tl.constexpr,
    UPCAST: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    # N-tile-major, as in _token_gemm_act_kernel; SPLIT programs share a (token, N tile), each
    # summing TOP_K / SPLIT of its experts (more weight bytes in flight per SM)
    pid = tl.program_id(0)
    part = pid % SPLIT
    t = (pid // SPLIT) % num_tokens
    tile = pid // SPLIT // num_tokens
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # The token's experts and weights, loaded once: inside the loop an expert id is picked out
    # of registers, so the weight loads' addresses depend on no load and pipeline freely.
    kk = tl.arange(0, K_P)
    slot0 = t.to(tl.int64) * TOP_K
    ids = tl.load(ids_ptr + slot0 + kk, mask=kk < TOP_K, other=-1).to(tl.int32)
    if USE_WEIGHTS:
        wts = tl.load(w_ptr + slot0 + kk, mask=kk < TOP_K, other=0.0).to(tl.float32)
    else:
        wts = tl.full((K_P,), 1.0, tl.float32)
    live = (ids >= 0) & (ids < E)
    ids = tl.where(live, ids, 0)
    wts = tl.where(live, wts, 0.0)
    NK: tl.constexpr = I_SIZE // BLOCK_K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one flat loop over (k, K tile): the pipeline runs across experts without draining
    K_PART: tl.constexpr = TOP_K // SPLIT
    for j in range(0, K_PART * NK):
        k = part * K_PART + j // NK
        kb = j % NK
        pick = kk == k
        e64 = tl.sum(tl.where(pick, ids, 0), axis=0).to(tl.int64)
        on = tl.sum(tl.where(pick & live, 1, 0), axis=0)  # 1 for a local expert, else 0
        cols = kb * BLOCK_K + offs_k
        a = tl.load(
            act_ptr + (slot0 + k) * stride_as + offs_m[:, None] * 0 + cols[None, :],
            mask=(offs_m < on)[:, None],
            other=0.0,
        )
        b = tl.load(
            b_ptr + e64 * stride_be + offs_n[None, :] * stride_bn + cols[:, None] * stride_bk,
            mask=n_mask[None, :] & (offs_k < on * BLOCK_K)[:, None],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
        # this expert's row is complete at its last K tile: round it as GEMM2's output, weigh
        # it, add it (selects, not a branch, so the loop body stays one straight pipeline)
        last = kb == NK - 1
        y = acc
        if HAS_SCALE:  # the expert's fp32 factor (NVFP4's global scales), before bias and rounding
            y = y * tl.load(scale_ptr + e64)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + e64 * stride_bias_e + offs_n, mask=offs_n < N * on, other=0.0)
            y += bias.to(tl.float32)[None, :]
        y = _to(y, out_ptr.dtype.element_ty, EXACT_ROUND).to(tl.float32)
        total = tl.where(last, total + y * tl.sum(tl.where(pick, wts, 0.0), axis=0), total)
        acc = tl.where(last, 0.0, acc)
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + offs_m[:, None] * 0 + offs_n[None, :]
    o_mask = (offs_m < 1)[:, None] & n_mask[None, :]
    if SPLIT == 1:
        tl.store(o_ptrs, _to(total * scaling, out_ptr.dtype.element_ty, EXACT_ROUND), mask=o_mask)
    else:
        # The last of the SPLIT programs to arrive sums every part in part order (so the result
        # does not depend on arrival order) and re-arms the counter for the next call.
        cell = tile.to(tl.int64) * num_tokens + t
        row = tl.sum(tl.where((offs_m == 0)[:, None], total, 0.0), axis=0)  # the live row
        cols = tl.arange(0, BLOCK_N)
        tl.store(partial_ptr + (cell * SPLIT + part) * BLOCK_N + cols, row)
        # Every thread's part is stored before the one atomic that publishes it: the release
        # orders only the issuing thread's own stores, so the others must reach this point
        # first. Triton 3.6 emits such a barrier before a scalar atomic itself (12,000 launches
        # bitwise identical on an H200, session 42); this states it rather than relying on it.
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + cell, 1, sem="acq_rel") == SPLIT - 1:
            sum_ = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for q in tl.static_range(SPLIT):
                sum_ += tl.load(partial_ptr + (cell * SPLIT + q) * BLOCK_N + cols, cache_modifier=".cg")
            tl.atomic_xchg(arrivals_ptr + cell, 0)
            res = _to(sum_ * scaling, out_ptr.dtype.element_ty, EXACT_ROUND)
            tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, res, mask=n_mask)


# --- host side ------------------------------------------------------------------------------


# Tiles, measured (tools/token_moe_sweep.py over 36 tiles of each kernel and 3 splits, at 1 and
# 4 tokens, on the three bench shapes; docs/device-runs/2026-11-23-session6):
# - GEMM1 + activation: 32-wide N tiles, 128-deep K tiles, 2 warps, 4 stages were the best or
#   within 3% of it on the H100 and the H200, except Mixtral-8x7B at one token on the H100 (3%
#   slower than its tuned fused tile), and 13% faster than the fused masked kernel's tuned
#   tile for Qwen3-30B-A3B at one token on the H200 (11.4 vs 13.2 us).
# - GEMM2 + combine: 32-wide N tiles, the deepest K tile, 2 warps, 4 stages, likewise; and
#   splitting the top-k sum over 2-4 programs per (token, N tile) took Qwen3-30B-A3B's at one
#   token from 13.4 to 8.1 us on the H200 (DeepSeek-V3 at 4 tokens: 224 -> 163 us).
TILE_N = 32
# Split the top-k sum until the grid has this many programs (at most 4 parts). On the H200, 256
# picks the measured best split in every case the layer runs (4 at one token for Qwen3-30B-A3B,
# 1 at four); 512 split Qwen3's 4-token combine in 2 and cost it ~7 us.
COMBINE_PROGRAMS = 256


def _decode_tile(n: int, k: int, depths: tuple[int, ...]) -> TileConfig:
    """`TILE_N` wide, the first of `depths` dividing K (else 64), 2 warps, 4 stages (see the
    note above); the interpreter takes few, small tiles."""
    if interpreting():
        return TileConfig(_BLOCK_M, 32 if n >= 32 else 16, 32 if k % 64 else 64, 1, 4, 1)
    return TileConfig(_BLOCK_M, TILE_N, next((b for b in depths if k % b == 0), 64), 1, 2, 4)


def token_config(n: int, k: int) -> TileConfig:
    """The GEMM1 + activation tile: 128 deep (64 where 128 does not divide K)."""
    return _decode_tile(n, k, (128,))


def combine_config(n: int, k: int) -> TileConfig:
    """The GEMM2 + combine tile: the deepest K tile dividing K (256, 128, 64)."""
    return _decode_tile(n, k, (256, 128))


def _tile(cfg: TileConfig, k: int, what: str) -> TileConfig:
    """A program's M tile is always 16 rows (one live): a tuned masked-GEMM tile's BLOCK_M is
    replaced; its K tile must divide K."""
    if k % cfg.block_k:
        raise ValueError(f"{what}: tile {cfg} needs a K tile dividing K={k}")
    return cfg if cfg.block_m == _BLOCK_M else replace(cfg, block_m=_BLOCK_M)


def token_gemm_act(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: TileConfig | None = None,
    *,
    activation: int,
    gated: bool,
    alpha: float = 0.0,
    limit: float = 0.0,
    out_scale: torch.Tensor | None = None,
    act_nvfp4_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s] = act(x[s // K] @ w13[ids[s]]^T (x out_scale[ids[s]]) + bias[ids[s]]) for every
    slot s = t * K + k. (Arguments: `bind_token_gemm_act`.)"""
    launch = bind_token_gemm_act(
        x, ids, w13, bias, out, config, activation=activation, gated=gated, alpha=alpha, limit=limit,
        out_scale=out_scale, act_nvfp4_scale=act_nvfp4_scale,
    )  # fmt: skip
    return out if launch is None else launch(x, ids, out)


def bind_token_gemm_act(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: TileConfig | None = None,
    *,
    activation: int,
    gated: bool,
    alpha: float = 0.0,
    limit: float = 0.0,
    out_scale: torch.Tensor | None = None,
    act_nvfp4_scale: torch.Tensor | None = None,
) -> _ActLaunch | None:
    """Check `token_gemm_act`'s arguments and choose its tile: its launch for this token count
    and these weights (None for no tokens), to call as `launch(x, ids, out)`.

    x `[T, H]` bf16/fp16 (rows contiguous); ids `[T, K]` int32/int64 local expert ids, -1 =
    not local (that slot's row of `out` is left as it is: `token_gemm_combine` skips it);
    w13 `[E, N13, H]` with N13 = 2 * I ([gate; up]) when gated, else I; bias `[E, N13]` or
    None; out `[T * K, I]` in x's dtype. `activation`: `moehal.kernels.triton_fused_moe` ids.
    out_scale: fp32 `[E]`, each expert's GEMM1 output multiplied by its factor before the bias
    and the rounding (NVFP4's global scales, `moehal_cuda.nvfp4_dequant`).
    act_nvfp4_scale: fp32 `[]` global scale: out's rows written as NVFP4 block values of the
    activation (`moehal.kernels.triton_nvfp4.nvfp4_qdq`; I a multiple of 16), GEMM2's input of
    an NVFP4 layer, in place of a quantizing launch. (x's rows are quantized by a launch before:
    quantized in the K loop as they were loaded, GEMM1 took 25.7 us at one token of
    Qwen3-30B-A3B on an H200 against 14.3 plus 2.7 for the launch; session 51.)
    No host synchronization: CUDA-graph capturable.
    """
    t, h = x.shape
    top_k = ids.shape[-1]
    e, n13, kw = w13.shape
    i = out.shape[-1]
    if kw != h or n13 != (2 * i if gated else i) or out.shape[0] != t * top_k or ids.shape[0] != t:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, ids {tuple(ids.shape)}, w13 {tuple(w13.shape)}, "
                         f"out {tuple(out.shape)}")  # fmt: skip
    if x.dtype != w13.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"takes bf16/fp16 operands of one dtype, got {x.dtype} and {w13.dtype}")
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not ids.is_contiguous():
        raise ValueError("x and out rows and the ids must be contiguous")
    cfg = _tile(config or token_config(i, h), h, "token_gemm_act")
    cfg = fused_act_config(cfg, h, x.element_size()) if gated else cfg
    _check_out_scale(out_scale, e)
    if act_nvfp4_scale is not None:
        _check_nvfp4(act_nvfp4_scale, i, cfg)
    if t == 0:
        return None
    return _ActLaunch.bind(t, top_k, w13, bias, cfg, activation, gated, alpha, limit, out_scale, act_nvfp4_scale)


def _check_nvfp4(scale: torch.Tensor, i: int, cfg: TileConfig) -> None:
    """NVFP4's 16-element groups of the activation must be whole in every N tile."""
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"act_nvfp4_scale must be an fp32 one-element global scale, got {scale.dtype} {scale.shape}")
    if i % 16 or cfg.block_n % 16:
        raise ValueError(f"NVFP4 quantization takes I={i} in 16-element groups; tile {cfg}")


def _check_out_scale(out_scale: torch.Tensor | None, e: int) -> None:
    if out_scale is not None and (out_scale.dtype != torch.float32 or tuple(out_scale.shape) != (e,)):
        raise ValueError(f"out_scale must be fp32 [{e}], got {out_scale.dtype} {tuple(out_scale.shape)}")


def combine_split(top_k: int, tokens: int, n: int, block_n: int) -> int:
    """Programs per (token, N tile) of `token_gemm_combine`: split the top-k experts in up to
    4 parts while the grid has fewer than `COMBINE_PROGRAMS` programs (a program streams its
    experts' weights one K tile after another; more programs per SM keep more bytes in flight)."""
    split = 1
    while split < 4 and top_k % (2 * split) == 0 and tokens * cdiv(n, block_n) * split < COMBINE_PROGRAMS:
        split *= 2
    return split


def token_gemm_combine(
    act: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    w2: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: TileConfig | None = None,
    *,
    scaling: float = 1.0,
    split: int | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = scaling * sum_k weights[t, k] * (act[t*K + k] @ w2[ids[t, k]]^T (x out_scale[ids[t,
    k]]) + bias[ids[t, k]]), over the local slots (id >= 0) in k order; weights None: an
    unweighted sum. (Arguments: `bind_token_gemm_combine`.)"""
    launch = bind_token_gemm_combine(
        act, ids, weights, w2, bias, out, config, scaling=scaling, split=split, out_scale=out_scale
    )
    return out if launch is None else launch(act, ids, weights, out)


def bind_token_gemm_combine(
    act: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    w2: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: TileConfig | None = None,
    *,
    scaling: float = 1.0,
    split: int | None = None,
    out_scale: torch.Tensor | None = None,
) -> _CombineLaunch | None:
    """Check `token_gemm_combine`'s arguments and choose its tile and split: its launch for
    this token count and these weights (None for no tokens), to call as
    `launch(act, ids, weights, out)`.

    act `[T * K, I]` (from `token_gemm_act`); ids `[T, K]`; weights fp32 `[T, K]`; w2
    `[E, H, I]` in act's dtype; bias `[E, H]` or None; out `[T, H]`. split: programs per
    (token, N tile), each summing top_k / split experts, a divisor of top_k (None:
    `combine_split`); the parts are added in a fixed order. out_scale: fp32 `[E]`, each
    expert's row multiplied by its factor before its bias and rounding. No host synchronization.
    """
    t, top_k = ids.shape
    e, h, i = w2.shape
    if act.shape != (t * top_k, i) or out.shape != (t, h) or act.dtype != w2.dtype:
        raise ValueError(f"shapes do not match: act {tuple(act.shape)} {act.dtype}, ids {tuple(ids.shape)}, "
                         f"w2 {tuple(w2.shape)} {w2.dtype}, out {tuple(out.shape)}")  # fmt: skip
    if weights is not None and (weights.shape != ids.shape or not weights.is_contiguous()):
        raise ValueError(f"weights must be contiguous {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if act.stride(-1) != 1 or out.stride(-1) != 1 or not ids.is_contiguous():
        raise ValueError("act and out rows and the ids must be contiguous")
    cfg = _tile(config or combine_config(h, i), i, "token_gemm_combine")
    _check_out_scale(out_scale, e)
    if t == 0:
        return None
    split = split or combine_split(top_k, t, h, cfg.block_n)
    if top_k % split:
        raise ValueError(f"split={split} does not divide top_k={top_k}")
    return _CombineLaunch.bind(t, top_k, w2, bias, cfg, split, scaling, weights is not None, out, out_scale)


# --- launches bound once per token count ---------------------------------------------------------


@dataclass(frozen=True)
class _ActLaunch:
    """`_token_gemm_act_kernel`'s launch for one token count and one layer's weights: all but
    x, ids and out fixed (grid, weight pointers and strides, constexprs)."""

    grid: tuple[int]
    weights: tuple  # w13, bias (or w13), the bias' expert stride
    tail: tuple  # w13's strides, alpha, limit, slots, the out_scale and NVFP4 pointers
    kw: dict

    @staticmethod
    def bind(
        t: int, top_k: int, w13: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig,
        activation: int, gated: bool, alpha: float, limit: float, out_scale: torch.Tensor | None = None,
        act_nvfp4_scale: torch.Tensor | None = None,
    ) -> _ActLaunch:  # fmt: skip
        e, _, h = w13.shape
        i = w13.shape[1] // 2 if gated else w13.shape[1]
        b = bias if bias is not None else w13
        return _ActLaunch(
            (t * top_k * cdiv(i, cfg.block_n),),
            (w13, b, b.stride(0) if bias is not None else 0),
            (
                w13.stride(0), w13.stride(1), w13.stride(2), float(alpha), float(limit), t * top_k,
                out_scale if out_scale is not None else w13,
                act_nvfp4_scale if act_nvfp4_scale is not None else w13,
            ),
            dict(
                E=e, TOP_K=top_k, I_SIZE=i, K=h, BLOCK_M=_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                ACT=activation, GATED=gated, HAS_BIAS=bias is not None, UPCAST=INTERPRETED,
                EXACT_ROUND=INTERPRETED, HAS_SCALE=out_scale is not None, NVFP4=act_nvfp4_scale is not None,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            ),
        )  # fmt: skip

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_token_gemm_act_kernel, self.grid, **self.kw)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._site(x, x.stride(0), ids, *self.weights, out, out.stride(0), *self.tail)
        return out


@dataclass(frozen=True)
class _CombineLaunch:
    """`_token_gemm_combine_kernel`'s launch for one token count and one layer's weights: all
    but act, ids, the router weights and out fixed. A split launch writes its partial sums to
    process-wide scratch (`triton_permute.scratch`), bound with the launch."""

    grid: tuple[int]
    cells: int  # (token, N tile) pairs
    partial_numel: int  # 0: no split
    weights: tuple  # w2, bias (or w2), the bias' expert stride
    tail: tuple  # w2's strides, scaling, tokens
    kw: dict
    device: torch.device  # out's: where the split's partial sums and arrival counters live

    @staticmethod
    def bind(
        t: int, top_k: int, w2: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig, split: int,
        scaling: float, use_weights: bool, out: torch.Tensor, out_scale: torch.Tensor | None = None,
    ) -> _CombineLaunch:  # fmt: skip
        e, h, i = w2.shape
        b = bias if bias is not None else w2
        cells = t * cdiv(h, cfg.block_n)
        out_dtype = out.dtype
        return _CombineLaunch(
            (cells * split,),
            cells,
            cells * split * cfg.block_n if split > 1 else 0,
            (w2, b, b.stride(0) if bias is not None else 0),
            (w2.stride(0), w2.stride(1), w2.stride(2), float(scaling), t, out_scale if out_scale is not None else w2),
            dict(
                E=e, TOP_K=top_k, K_P=max(2, next_power_of_2(top_k)), SPLIT=split, N=h, I_SIZE=i,
                BLOCK_M=_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
                USE_WEIGHTS=use_weights, UPCAST=INTERPRETED,
                EXACT_ROUND=INTERPRETED and out_dtype == torch.bfloat16, HAS_SCALE=out_scale is not None,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            ),
            out.device,
        )  # fmt: skip

    @functools.cached_property
    def _split_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(partial sums, arrival counters) of a split launch: process-wide (`scratch`)."""
        if not self.partial_numel:
            return None
        partial = scratch("token.partial", (self.partial_numel,), torch.float32, self.device)
        return partial, arrivals(self.cells, self.device)

    def __call__(
        self, act: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor
    ) -> torch.Tensor:
        w2, b, sb = self.weights
        partial, arrivals = self._split_buffers or (out, out)  # (unused without a split)
        self._site(
            act, act.stride(0), ids, weights if weights is not None else ids, w2, b, sb, out, out.stride(0),
            partial, arrivals, *self.tail,
        )  # fmt: skip
        return out

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_token_gemm_combine_kernel, self.grid, **self.kw)


class TokenMoE:
    """`token_gemm_act` then `token_gemm_combine` on one layer's weights, for the eager decode
    steps of `cuda.deepgemm`'s token-major format.

    Why: at one token the two kernels take about 30 us of GPU time, and the wrappers' shape
    checks, tile rules and argument lists cost an eager call more host time than the launches
    themselves. Here they run once per token count (the checked functions above, on the first
    call); later calls check only what a call can change (row strides, contiguity) and launch.
    """

    def __init__(
        self,
        w13: torch.Tensor,
        w13_bias: torch.Tensor | None,
        w2: torch.Tensor,
        w2_bias: torch.Tensor | None,
        *,
        activation: int,
        gated: bool,
        alpha: float,
        limit: float,
        scaling: float,
        w13_out_scale: torch.Tensor | None = None,
        w2_out_scale: torch.Tensor | None = None,
        act_nvfp4_scale: torch.Tensor | None = None,
    ) -> None:
        """w13_out_scale, w2_out_scale: each GEMM's per-expert fp32 factors (`token_gemm_act`,
        `token_gemm_combine`); act_nvfp4_scale: the global scale of GEMM2's input, quantized to
        NVFP4 as the first kernel writes it (`token_gemm_act`)."""
        self.w13, self.w13_bias, self.w2, self.w2_bias = w13, w13_bias, w2, w2_bias
        self.activation, self.gated, self.alpha, self.limit, self.scaling = activation, gated, alpha, limit, scaling
        self.w13_out_scale, self.w2_out_scale, self.act_nvfp4_scale = w13_out_scale, w2_out_scale, act_nvfp4_scale
        # (token count, weighted) -> the two launches and the activation rows between them
        self._plans: dict[tuple[int, bool], tuple[_ActLaunch, _CombineLaunch, torch.Tensor]] = {}

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor
    ) -> torch.Tensor:
        """out `[T, H]` = the layer's result for x `[T, H]`, local ids `[T, K]` and fp32 router
        weights `[T, K]` (contiguous; None: unweighted). The activation rows between the two
        kernels are process-wide scratch (`triton_permute.scratch`): calls of layers of one
        shape must not overlap on different streams, as with the permute's workspaces (`MoELayer`
        orders its forwards across streams: `moehal.stream_order`)."""
        plan = self._plans.get((ids.shape[0], weights is not None))
        if (
            plan is None or x.stride(-1) != 1 or out.stride(-1) != 1 or not ids.is_contiguous()
            or (weights is not None and not weights.is_contiguous())
        ):  # fmt: skip
            return self._checked(x, ids, weights, out)
        first, second, act = plan
        first(x, ids, act)
        return second(act, ids, weights, out)

    def _checked(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor
    ) -> torch.Tensor:
        """The first call of a token count (or an unusual one): the checked binds, which raise
        on what the kernels cannot take; their launches are kept for the token count."""
        t, top_k = ids.shape
        shape = (t * top_k, self.w2.shape[2])
        act = scratch("token.act", shape, x.dtype, x.device) if t else x.new_empty(shape)
        first = bind_token_gemm_act(
            x, ids, self.w13, self.w13_bias, act, activation=self.activation, gated=self.gated,
            alpha=self.alpha, limit=self.limit, out_scale=self.w13_out_scale, act_nvfp4_scale=self.act_nvfp4_scale,
        )  # fmt: skip
        second = bind_token_gemm_combine(
            act, ids, weights, self.w2, self.w2_bias, out, scaling=self.scaling, out_scale=self.w2_out_scale
        )
        if first is None or second is None:  # no tokens
            return out
        self._plans[(t, weights is not None)] = (first, second, act)
        first(x, ids, act)
        return second(act, ids, weights, out)
