"""Host-side weight layouts of the FlashInfer SM100 MoE kernels, in pure torch (run once at load,
tested on CPU against the documented index formulas; the kernels themselves need SM100).

- TensorRT-LLM-gen MoE: GEMM1 computes (X1 = linear/up, X2 = gate), so W13 is stored
  [w3 (up); w1 (gate)] (`swap_w13_halves`), per-tensor FP8 additionally row-interleaves the
  halves (`reorder_rows_for_gated_act`) and every weight is row-shuffled for the epilogue
  tile (`shuffle_rows_for_epilogue`, trtllm-gen `shuffleMatrixA`).
- NVFP4 block scales: the 128x4 swizzled layout of the FP4 tensor cores
  (`swizzle_block_scales_128x4`, FlashInfer `block_scale_interleave`).
- CuteDSL NVFP4 standard path: [up, gate] halves interleaved in 64-row chunks
  (`interleave_w13_halves`); masked (DeepEP low-latency) path keeps [gate, up].

moehal's canonical W13 is [gate; up] = [w1; w3] (see `moehal.weights`).
"""

from __future__ import annotations

import torch

# trtllm-gen shuffleMatrixA: within each block of 16 (epilogue tile M not a multiple of 128)
# or 32 rows, source row i goes to destination row _ROW_MAP[i].
_ROW_MAP_16 = [8 * c + r for r in range(8) for c in range(2)]  # 0, 8, 1, 9, 2, 10, ...
_ROW_MAP_32 = [8 * c + r for r in range(8) for c in range(4)]  # 0, 8, 16, 24, 1, 9, 17, 25, ...


def swap_w13_halves(w: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """[gate; up] <-> [up; gate] along `dim` (an involution). Works for weights `[E, 2I, K]`
    and for their block scales `[E, 2I/128, K/128]` (halves of whole blocks)."""
    n = w.shape[dim]
    if n % 2:
        raise ValueError(f"w13 dim {dim} has odd size {n}")
    a, b = w.split(n // 2, dim=dim)
    return torch.cat([b, a], dim=dim).contiguous()


def gated_act_row_indices(m: int) -> torch.Tensor:
    """trtllm-gen reorderRowsForGatedActGemm: new row 2j = old row j (first half),
    new row 2j+1 = old row m/2 + j (second half)."""
    if m % 2:
        raise ValueError(f"rows must be even, got {m}")
    idx = torch.arange(m)
    out = torch.empty_like(idx)
    out[0::2] = idx[: m // 2]
    out[1::2] = idx[m // 2 :]
    return out


def reorder_rows_for_gated_act(w: torch.Tensor) -> torch.Tensor:
    """Apply `gated_act_row_indices` to the rows (dim -2) of `[..., M, K]`."""
    return w.index_select(-2, gated_act_row_indices(w.shape[-2]).to(w.device)).contiguous()


def shuffle_row_indices(m: int, epilogue_tile_m: int) -> torch.Tensor:
    """Row gather indices of trtllm-gen shuffleMatrixA: result[new] = source[indices[new]]."""
    block = 32 if epilogue_tile_m % 128 == 0 else 16
    if m % block:
        raise ValueError(f"rows ({m}) must be a multiple of {block} for epilogue tile {epilogue_tile_m}")
    row_map = torch.tensor(_ROW_MAP_32 if block == 32 else _ROW_MAP_16)
    old = torch.arange(m)
    new = old // block * block + row_map[old % block]
    idx = torch.empty_like(old)
    idx[new] = old
    return idx


def shuffle_rows_for_epilogue(w: torch.Tensor, epilogue_tile_m: int) -> torch.Tensor:
    """Apply `shuffle_row_indices` to the rows (dim -2) of `[..., M, K]` (weights of any dtype,
    including packed FP4 bytes and per-row block scales)."""
    return w.index_select(-2, shuffle_row_indices(w.shape[-2], epilogue_tile_m).to(w.device)).contiguous()


def swizzle_block_scales_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Linear block scales `[..., M, K_sf]` -> the 128x4 swizzled layout, flattened per leading
    index: rows padded to 128 and columns to 4 (with zeros); element (m, k) with
    m = 128*mt + 32*r4 + r32 and k = 4*kt + k4 lands at [mt, kt, r32, r4, k4]."""
    *lead, m, k = sf.shape
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    pad = torch.zeros(*lead, mp, kp, dtype=sf.dtype, device=sf.device)
    pad[..., :m, :k] = sf
    v = pad.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
    n = len(lead)
    perm = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    return v.permute(*perm).contiguous().reshape(*lead, mp * kp)


def unswizzle_block_scales_128x4(flat: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of `swizzle_block_scales_128x4` (drops the padding)."""
    *lead, _ = flat.shape
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    v = flat.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
    n = len(lead)
    perm = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    return v.permute(*perm).reshape(*lead, mp, kp)[..., :m, :k].contiguous()


def interleave_w13_halves(w: torch.Tensor, group: int = 64, dim: int = 1) -> torch.Tensor:
    """Alternate `group`-row chunks of the two halves along `dim`: first-half chunk 0,
    second-half chunk 0, first-half chunk 1, ... (feed [up; gate] for CuteDSL's GEMM1)."""
    n = w.shape[dim]
    if n % 2 or (n // 2) % group:
        raise ValueError(f"dim {dim} size {n} must be even with halves a multiple of {group}")
    a, b = w.split(n // 2, dim=dim)
    shape = list(a.shape)
    chunks = shape[dim] // group
    new = shape[:dim] + [chunks, group] + shape[dim + 1 :]
    stacked = torch.stack([a.reshape(new), b.reshape(new)], dim=dim + 1)
    return stacked.reshape(list(w.shape)).contiguous()


def deinterleave_w13_halves(w: torch.Tensor, group: int = 64, dim: int = 1) -> torch.Tensor:
    """Inverse of `interleave_w13_halves`."""
    n = w.shape[dim]
    shape = list(w.shape)
    chunks = n // (2 * group)
    v = w.reshape(shape[:dim] + [chunks, 2, group] + shape[dim + 1 :])
    a = v.select(dim + 1, 0).reshape(shape[:dim] + [n // 2] + shape[dim + 1 :])
    b = v.select(dim + 1, 1).reshape(shape[:dim] + [n // 2] + shape[dim + 1 :])
    return torch.cat([a, b], dim=dim).contiguous()
