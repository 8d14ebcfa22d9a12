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

Interpreter (TRITON_INTERPRET=1): bf16 `tl.dot` is wrong there, so dot operands are upcast to
fp32 (UPCAST); compiled kernels never upcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from moehal.kernels.triton_experts import interpreting

GROUP = 128  # fp8 block size


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration. `as_dict` / `from_dict` use the names of the tuned JSON tables."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> GemmConfig:
        return cls(
            int(d["BLOCK_M"]),
            int(d["BLOCK_N"]),
            int(d["BLOCK_K"]),
            int(d.get("GROUP_M", 1)),
            int(d.get("num_warps", 4)),
            int(d.get("num_stages", 3)),
        )

    def fits(self, n: int, k: int, fp8: bool) -> bool:
        """Whether the kernel can run this tile on an (N, K) problem: K tiles must divide K
        (the K loop has no tail), and an FP8 K tile must not straddle two scale groups."""
        if k % self.block_k or (fp8 and GROUP % self.block_k):
            return False
        return self.block_n <= max(16, triton.next_power_of_2(n))


def default_config(rows_per_expert: int, n: int, k: int, fp8: bool) -> GemmConfig:
    """A reasonable tile when no tuned entry exists (interpreter: few, wide tiles)."""
    if interpreting():
        bk = 32 if k % 64 else 64
        return GemmConfig(16, 64, bk, 1, 4, 1)
    bk = 128 if fp8 or k % 128 == 0 else 64
    if rows_per_expert <= 16:
        return GemmConfig(16, 64, bk, 1, 4, 4)
    if rows_per_expert <= 64:
        return GemmConfig(64, 64, 64 if not fp8 else 128, 8, 4, 4)
    return GemmConfig(128, 128, 64 if not fp8 else 128, 8, 8, 3)


@triton.jit(do_not_specialize=["num_m_tiles"])
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
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order over (M tile, N tile): GROUP_M M tiles share each weight tile in L2.
    in_group = GROUP_M * num_pid_n
    group_id = pid // in_group
    first_m = group_id * GROUP_M
    group_size = min(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % group_size)
    pid_n = (pid % in_group) // group_size

    # The tile table, from masked_m: expert e owns tiles [ends[e] - tiles[e], ends[e]).
    j = tl.arange(0, E_P)
    cnt = tl.load(masked_m_ptr + j, mask=j < E, other=0)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    if e >= E:
        return
    first_tile = tl.sum(tl.where(j < e, tiles, 0), axis=0)
    rows = tl.sum(tl.where(j == e, cnt, 0), axis=0)
    e64 = e.to(tl.int64)

    offs_m = (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + e64 * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + e64 * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        as_ptrs = a_scale_ptr + e64 * stride_ase + offs_m * stride_asm
        bs_ptrs = b_scale_ptr + e64 * stride_bse + (offs_n // 128) * stride_bsn
    for kb in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=m_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + e64 * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def num_m_tiles(total_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on the live M tiles: each non-empty expert wastes at most one partial tile,
    and at most min(E, S) experts are non-empty."""
    s = max(int(total_rows), 0)
    return triton.cdiv(s, block_m) + min(num_experts, s)


def masked_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    masked_m: torch.Tensor,
    total_rows: int,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """out[e, :masked_m[e]] = a[e, :masked_m[e]] @ w[e]^T; other rows of `out` untouched.

    a `[E, max_m, K]` bf16/fp16, or fp8 e4m3 with `a_scale` fp32 `[E, max_m, K/128]` (any
    strides; MN-major as DeepGEMM takes them is fine); w `[E, N, K]` (K-major) in a's dtype,
    fp8 with `w_scale` fp32 `[E, N/128, K/128]`; out `[E, max_m, N]`; masked_m int32 `[E]`.
    total_rows: host int >= sum(masked_m) (sizes the grid; never read from the device).
    No host synchronization: CUDA-graph capturable.
    """
    e, max_m, k = a.shape
    n = w.shape[1]
    fp8 = a_scale is not None
    if w.shape[0] != e or w.shape[2] != k or tuple(out.shape) != (e, max_m, n):
        raise ValueError(f"shapes do not match: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if fp8 and w_scale is None:
        raise ValueError("fp8 activations need weight scales")
    cfg = config or default_config(max(1, total_rows // max(e, 1)), n, k, fp8)
    if not cfg.fits(n, k, fp8):
        raise ValueError(f"tile {cfg} does not fit N={n}, K={k} (K tiles must divide K)")
    tiles_m = num_m_tiles(min(total_rows, e * max_m), e, cfg.block_m)
    if tiles_m == 0 or n == 0:
        return out
    grid = (tiles_m * triton.cdiv(n, cfg.block_n),)
    sa = a_scale if a_scale is not None else out
    sw = w_scale if w_scale is not None else out
    ase, asm, ask = (sa.stride(0), sa.stride(1), sa.stride(2)) if fp8 else (0, 0, 0)
    bse, bsn, bsk = (sw.stride(0), sw.stride(1), sw.stride(2)) if fp8 else (0, 0, 0)
    _masked_gemm_kernel[grid](
        a,
        sa,
        w,
        sw,
        out,
        masked_m,
        tiles_m,
        a.stride(0),
        a.stride(1),
        a.stride(2),
        ase,
        asm,
        ask,
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bse,
        bsn,
        bsk,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        E=e,
        E_P=max(16, triton.next_power_of_2(e)),
        N=n,
        K=k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        FP8=fp8,
        UPCAST=interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
