"""Token permutation in pure torch, free of host-device syncs.

Moves the T*K (token, k) slots into the expert-sorted contiguous or the masked layout and
back. Every size is static (derived from shapes, never from routed counts), so these run
inside CUDA graphs. The reference dispatcher uses them on any device; GPU backends may
replace them with fused kernels, and are tested against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True, slots=True)
class SlotIndex:
    """Where each (token, k) slot goes. S = T*K slots, flattened token-major.

    slot_expert: int64 `[S]` local expert, or E_local for slots of experts not on this rank.
    slot_pos: int64 `[S]` position of the slot among its expert's slots (stable by slot).
    valid: bool `[S]` the slot's expert is local.
    counts: int32 `[E_local]` slots per local expert.
    """

    slot_expert: torch.Tensor
    slot_pos: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor
    num_tokens: int
    top_k: int
    num_local_experts: int


def index_slots(topk_ids: torch.Tensor, expert_start: int, num_local_experts: int) -> SlotIndex:
    """topk_ids `[T, K]` global ids -> SlotIndex for the experts [start, start+E_local)."""
    t, k = topk_ids.shape
    e = num_local_experts
    local = topk_ids.reshape(-1).to(torch.int64) - expert_start
    valid = (local >= 0) & (local < e)
    slot_expert = torch.where(valid, local, torch.full_like(local, e))
    counts_all = torch.zeros(e + 1, dtype=torch.int64, device=topk_ids.device)
    counts_all.scatter_add_(0, slot_expert, torch.ones_like(slot_expert))
    order = torch.argsort(slot_expert, stable=True)
    starts = torch.cumsum(counts_all, 0) - counts_all
    pos_sorted = torch.arange(t * k, device=topk_ids.device) - starts[slot_expert[order]]
    slot_pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
    return SlotIndex(slot_expert, slot_pos, valid, counts_all[:e].to(torch.int32), t, k, e)


def slot_tokens(idx: SlotIndex) -> torch.Tensor:
    """Token index of each slot, int64 `[S]`."""
    return torch.arange(idx.num_tokens * idx.top_k, device=idx.slot_expert.device) // idx.top_k


# --- masked [E_local, max_m, H] ---------------------------------------------------------------


def to_masked(x: torch.Tensor, idx: SlotIndex, max_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]` -> (hidden `[E_local, max_m, H]` zero-padded, masked_m int32 `[E_local]`).

    max_m must be at least the largest count; T is always enough (ids of a token are distinct).
    Slots past `max_m` (only unchecked input that repeats an id within a token gets there) are
    dropped, and masked_m is clamped to `max_m`: the experts' GEMMs trust masked_m as a row
    bound, so a larger count would make them read and write past the buffer.
    """
    h = x.shape[-1]
    out = torch.zeros(idx.num_local_experts + 1, max(max_m, 1), h, dtype=x.dtype, device=x.device)
    kept = _kept_masked(idx, max_m)
    expert = torch.where(kept, idx.slot_expert, torch.full_like(idx.slot_expert, idx.num_local_experts))
    pos = torch.where(kept, idx.slot_pos, torch.zeros_like(idx.slot_pos))
    out[expert, pos] = x[slot_tokens(idx)]  # dropped slots land in the spare slab
    return out[: idx.num_local_experts, :max_m], idx.counts.clamp(max=max_m)


def from_masked(y: torch.Tensor, idx: SlotIndex, weights: torch.Tensor) -> torch.Tensor:
    """y `[E_local, max_m, H]` -> `[T, H]` float32: sum over k of weight * row (the slots
    `to_masked` kept only)."""
    if y.shape[1] == 0 or idx.num_tokens == 0:
        return torch.zeros(idx.num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    kept = _kept_masked(idx, y.shape[1])
    e = idx.slot_expert.clamp(max=idx.num_local_experts - 1)
    pos = torch.where(kept, idx.slot_pos, torch.zeros_like(idx.slot_pos))
    rows = y[e, pos].float()
    return _weighted_sum(rows, idx, weights, kept)


def _kept_masked(idx: SlotIndex, max_m: int) -> torch.Tensor:
    """The slots the masked layout holds: local ones within their expert's `max_m` rows."""
    return idx.valid & (idx.slot_pos < max_m)


# --- contiguous [M_pad, H] --------------------------------------------------------------------


def contiguous_rows(num_slots: int, num_local_experts: int, alignment: int) -> int:
    """Static worst-case rows of the contiguous layout for `num_slots` (token, k) slots, each
    expert's segment starting at a multiple of `alignment`. At most min(E, S) experts receive
    slots, so only those can waste up to alignment-1 padding rows each. No slots: 0 rows (a
    dispatcher that knows so on the host hands over none, and experts return at once)."""
    if num_slots == 0:
        return 0
    busy = min(num_local_experts, num_slots)
    return max(round_up(num_slots + busy * (alignment - 1), alignment), alignment)


def masked_rows(max_tokens: int, alignment: int = 64) -> int:
    """Per-expert rows of the masked layout: every token can route to an expert at most once,
    so max_tokens is the worst case; rounded up so that GEMM tiles never straddle experts."""
    return round_up(max(max_tokens, 1), alignment)


def to_contiguous(
    x: torch.Tensor, idx: SlotIndex, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[T, H]` -> (hidden `[M_pad, H]`, row_expert int32 `[M_pad]`, segment_start int32
    `[E_local]`, slot_row int64 `[S]`). Each expert's segment starts at a multiple of
    `alignment`; row_expert marks an expert's rows with it, and its padding rows and the tail
    with -1 (DeepGEMM's `m_indices`)."""
    e, dev = idx.num_local_experts, x.device
    m_pad = contiguous_rows(idx.num_tokens * idx.top_k, e, alignment)
    counts = idx.counts.to(torch.int64)
    aligned = (counts + alignment - 1) // alignment * alignment
    seg_end = torch.cumsum(aligned, 0)
    seg_start = seg_end - aligned
    slot_row = torch.where(
        idx.valid,
        seg_start[idx.slot_expert.clamp(max=max(e - 1, 0))] + idx.slot_pos,
        torch.full_like(idx.slot_pos, m_pad),
    )
    out = torch.zeros(m_pad + 1, x.shape[-1], dtype=x.dtype, device=dev)
    out[slot_row] = x[slot_tokens(idx)]  # invalid slots land in the spare last row
    rows = torch.arange(m_pad, device=dev)
    seg = torch.searchsorted(seg_end, rows, right=True)
    seg_c = seg.clamp(max=max(e - 1, 0))
    live = (seg < e) & (rows - seg_start[seg_c] < counts[seg_c]) if e else seg < e
    row_expert = torch.where(live, seg, torch.full_like(seg, -1)).to(torch.int32)
    return out[:m_pad], row_expert, seg_start.to(torch.int32), slot_row


def from_contiguous(y: torch.Tensor, idx: SlotIndex, slot_row: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y `[M_pad, H]` -> `[T, H]` float32: sum over k of weight * row (local slots only)."""
    if y.shape[0] == 0 or idx.num_tokens == 0:
        return torch.zeros(idx.num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    rows = y[slot_row.clamp(max=y.shape[0] - 1)].float()
    return _weighted_sum(rows, idx, weights)


def _weighted_sum(
    rows: torch.Tensor, idx: SlotIndex, weights: torch.Tensor, kept: torch.Tensor | None = None
) -> torch.Tensor:
    kept = idx.valid if kept is None else kept
    w = torch.where(kept, weights.reshape(-1).float(), torch.zeros((), device=rows.device))
    rows = torch.where(kept[:, None], rows, torch.zeros((), device=rows.device))  # NaN-safe
    return (rows * w[:, None]).view(idx.num_tokens, idx.top_k, -1).sum(1)


def local_topk_ids(topk_ids: torch.Tensor, expert_start: int, num_local_experts: int) -> torch.Tensor:
    """Global ids -> local ids int32, -1 for experts not on this rank (the STANDARD layout)."""
    local = topk_ids.to(torch.int64) - expert_start
    valid = (local >= 0) & (local < num_local_experts)
    return torch.where(valid, local, torch.full_like(local, -1)).to(torch.int32)
