"""Torch stand-ins for the Ascend vendor ops the NPU backend calls (emulated mode only).

Used only when emulation is switched on explicitly (`MOEHAL_EMULATE=npu`, or
`Settings(emulate={'npu'})`); reports then say `emulated`. Each function implements the
*documented* semantics of one vendor op, cites the page it follows, and states what the
documentation leaves open and how the emulation fills it in. The backend's orchestration
(layouts, group lists, quantization math, weight permutes) never depends on those gaps: it
masks rows the documentation leaves unspecified.

Arithmetic: integer GEMMs accumulate exactly (float64 holds every int8 x int8 sum over
K <= 2^37 terms exactly), float GEMMs in float32; outputs are rounded to the dtype the op
documents. Roundings follow `torch.round` (half to even); the kernels' tie rule is not
documented.

Sources: torch_npu API reference (PyTorch 7.0.0),
www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/<page>.html:
- npu_grouped_matmul ........... ptaoplist_001237
- npu_swiglu .................... ptaoplist_000986 (`npu_swiglu(x, dim=-1)`)
- npu_dequant_swiglu_quant ...... ptaoplist_002367
- npu_moe_init_routing_v2 ....... ptaoplist_002366
- npu_moe_distribute_dispatch ... ptaoplist_002364, npu_moe_distribute_combine ptaoplist_002363
- npu_format_cast ............... ptaoplist_000154
DeepEP-Ascend (sgl-project/sgl-kernel-npu): `python/deep_ep/doc/FUSED_DEEP_MOE.md` (fused_deep_moe, FuseMode),
its `Buffer.fused_deep_moe` docstring and the FusedDeepMoe tiling checks
(`csrc/deepep/ops/op_host/fused_deep_moe_tiling.cpp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

INT8_MAX = 127.0
_TINY = 1e-12

# --- helpers ----------------------------------------------------------------------------------


def group_bounds(group_list: torch.Tensor, group_list_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) int64 `[G]` of the row groups of a split-M grouped matmul.

    group_list_type 0: group_list holds cumulative ends (group g = rows [end[g-1], end[g]));
    1: it holds per-group counts (ptaoplist_001237, "group_list_type")."""
    gl = group_list.to(torch.int64)
    if group_list_type == 0:
        ends = gl
    elif group_list_type == 1:
        ends = torch.cumsum(gl, 0)
    else:
        raise NotImplementedError(f"group_list_type {group_list_type} (2 = (expert, count) pairs) is not emulated")
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=gl.device), ends[:-1]])
    return starts, ends


def row_groups(num_rows: int, group_list: torch.Tensor, group_list_type: int) -> torch.Tensor:
    """Group index of every row, int64 `[num_rows]`; -1 for rows past the last group's end."""
    _, ends = group_bounds(group_list, group_list_type)
    rows = torch.arange(num_rows, device=group_list.device)
    g = torch.searchsorted(ends, rows, right=True)
    return torch.where(g < ends.numel(), g, torch.full_like(g, -1))


def _per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.float().abs().amax(dim=-1).clamp_min(_TINY) / INT8_MAX
    q = torch.round(x.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _check_dtype(op: str, arg: str, t: torch.Tensor, want: torch.dtype, source: str) -> None:
    """Refuse an operand of another dtype, as the vendor op's own argument check does."""
    if t.dtype != want:
        raise ValueError(f"{op}: {arg} must be {want} ({source}), got {t.dtype}")


# --- torch_npu ops -----------------------------------------------------------------------------


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    scale: list[torch.Tensor] | None = None,
    per_token_scale: list[torch.Tensor] | None = None,
    group_list: torch.Tensor,
    split_item: int = 2,
    group_type: int = 0,
    group_list_type: int = 0,
    output_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """ptaoplist_001237, the MoE form only: one x `[M, K]`, one weight `[G, K, N]`,
    group_type 0 (split M), split_item 2 or 3 (one output `[M, N]`).

    Rows of group g: see `group_bounds`. Per group: y = x_g @ weight[g] (+ bias[g]).
    Float x: float32 accumulation, output in x.dtype (or output_dtype).
    int8 x (W8A8): int32 accumulation; with `scale` [G, N] (per-channel weight scale) and
    optional `per_token_scale` [M]: y = acc * scale[g] * per_token_scale[row], output in
    output_dtype (bf16); without scales output_dtype must be int32 (the raw accumulator).
    Rows past the last group's end: not specified by the documentation; zeros here.
    """
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError("only the single-tensor split-M MoE form of npu_grouped_matmul is emulated")
    a, w = x[0], weight[0]
    m, n = a.shape[0], w.shape[-1]
    g = row_groups(m, group_list, group_list_type)
    live = g >= 0
    gi = g.clamp(min=0)
    quantized = a.dtype == torch.int8
    if quantized:
        acc = torch.einsum("mk,mkn->mn", a.double(), w.double()[gi]) if m else a.new_zeros(0, n, dtype=torch.float64)
        if scale is None:
            if output_dtype != torch.int32:
                raise ValueError(
                    "int8 grouped matmul without scales returns the int32 accumulator (output_dtype=int32)"
                )
            return [torch.where(live[:, None], acc, 0.0).to(torch.int32)]
        out_dtype = output_dtype or torch.bfloat16
        # Atlas A2/A3, int8 x with per-token scales: a bf16 output takes a bf16 weight scale and
        # an fp16 output an fp32 one (the op's documented dtype table; fp32 with bf16 only on 910_95)
        want = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}.get(out_dtype)
        if per_token_scale is not None and scale[0].dtype != want:
            raise ValueError(
                f"int8 grouped matmul with per-token scales: a {out_dtype} output takes a {want} weight scale, "
                f"got {scale[0].dtype}"
            )
        y = acc * scale[0].double()[gi]
        if per_token_scale is not None:
            y = y * per_token_scale[0].double()[:, None]
    else:
        y = torch.einsum("mk,mkn->mn", a.float(), w.float()[gi]) if m else a.new_zeros(0, n, dtype=torch.float32)
        out_dtype = output_dtype or a.dtype
    if bias is not None:
        y = y + bias[0].to(y.dtype)[gi]
    return [torch.where(live[:, None], y, 0.0).to(out_dtype)]


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """ptaoplist_000986: split x in two halves along `dim`: silu(first) * second, in x.dtype
    (computed in float32)."""
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_dequant_swiglu_quant(
    x: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    activation_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    activate_left: bool = False,
    quant_mode: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ptaoplist_002367. x int32 `[M, 2N]` (a grouped matmul's accumulator).

    dequant: x * weight_scale[group(row)] (`[G, 2N]`) * activation_scale[row] (`[M]`), both
    float32 (the page's parameter list; another dtype is refused);
    swiglu: activate_left=True -> silu(left half) * right half, False -> silu(right) * left;
    quant_mode 1 (dynamic): per-row int8 with scale = rowmax / 127 (times quant_scale if given).
    group_index `[G]`: rows per group (count form). Returns (int8 `[M, N]`, float32 `[M]`).
    Rows past sum(group_index): unspecified in the documentation; zeros here.
    """
    if quant_mode != 1 or quant_offset is not None or bias is not None:
        raise NotImplementedError("only dynamic quantization (quant_mode=1) without bias/offset is emulated")
    from moehal_npu.ops import DEQUANT_SWIGLU_ALIGN, DEQUANT_SWIGLU_MAX

    n = x.shape[-1] // 2
    if group_index is not None and (n > DEQUANT_SWIGLU_MAX or n % DEQUANT_SWIGLU_ALIGN):
        raise ValueError(
            f"npu_dequant_swiglu_quant with group_index: output width {n} must be <= {DEQUANT_SWIGLU_MAX} "
            f"and a multiple of {DEQUANT_SWIGLU_ALIGN}"
        )
    # ptaoplist_002367, parameter list: weight_scale and activation_scale "数据类型支持float32"
    for arg, t in (("weight_scale", weight_scale), ("activation_scale", activation_scale)):
        if t is not None:
            _check_dtype("npu_dequant_swiglu_quant", arg, t, torch.float32, "ptaoplist_002367")
    m = x.shape[0]
    y = x.double()
    if group_index is not None:
        g = row_groups(m, group_index, 1)
    else:
        g = torch.zeros(m, dtype=torch.int64, device=x.device)
    live = g >= 0
    gi = g.clamp(min=0)
    if weight_scale is not None:
        ws = weight_scale.double()
        y = y * (ws[gi] if ws.dim() == 2 else ws)
    if activation_scale is not None:
        y = y * activation_scale.double().reshape(-1)[:, None]
    left, right = y.float().chunk(2, dim=-1)
    a = torch.nn.functional.silu(left) * right if activate_left else torch.nn.functional.silu(right) * left
    if quant_scale is not None:
        a = a * quant_scale.float()
    a = torch.where(live[:, None], a, 0.0)
    return _per_token_quant(a)


def npu_format_cast(t: torch.Tensor, acl_format: int) -> torch.Tensor:
    """ptaoplist_000154. Changes the *physical* layout (29 = ACL_FORMAT_FRACTAL_NZ, the
    tiled layout grouped matmuls read fastest); the logical tensor, and so every result
    computed from it, is unchanged. Emulated as the identity: the call stays in the
    orchestration so its place in weight processing is exercised, but NZ tiling itself is
    not modelled."""
    return t


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: list[int] | None = None,
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ptaoplist_002366 (dropless mode, drop_pad_mode=0, row_idx_type=0).

    x `[N, H]`, expert_idx int32 `[N, K]`. The N*K (token, k) slots, flattened token-major
    (row = t*K + k), are stably sorted by expert id; slots whose expert lies outside
    active_expert_range [start, end) are dropped. Returns
    - expanded_x `[N*K, H]`: the kept slots' token rows in sorted order (int8 when
      quant_mode=1, dynamic per-token quantization; else x.dtype); rows past the kept count
      are unspecified by the documentation (zeros here);
    - expanded_row_idx int32 `[N*K]`: the gather index, expanded_row_idx[row] = position of
      slot `row` in expanded_x (row_idx_type=0); -1 for dropped slots (the documentation
      leaves their value open; the backend masks them by expert range itself);
    - expert_tokens_count_or_cumsum int64 `[end - start]`: counts (type 1). The kernel behind
      the op (aclnnMoeInitRoutingV3) refuses type 0, the cumulative form, on Ascend 950
      ("expert_tokens_num_type currently not support 0"; Atlas A2/A3 accept it), and so does
      this, the strictest chip's rule; type 2 (key-value pairs) is not emulated;
    - expanded_scale float32 `[N*K]`: per-row dynamic scale (quant_mode=1), else unspecified.
    """
    if drop_pad_mode != 0 or row_idx_type != 0 or quant_mode not in (-1, 1) or scale is not None:
        raise NotImplementedError("only dropless routing, gather row index, no/dynamic quant is emulated")
    if expert_tokens_num_type not in (1, 2):
        raise ValueError(f"expert_tokens_num_type currently not support {expert_tokens_num_type}")
    if expert_tokens_num_type == 2:
        raise NotImplementedError("expert_tokens_num_type=2 (key-value pairs) is not emulated")
    _check_dtype("npu_moe_init_routing_v2", "expert_idx", expert_idx, torch.int32, "ptaoplist_002366")
    n, k = expert_idx.shape
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    ids = expert_idx.reshape(-1).to(torch.int64)
    kept = (ids >= start) & (ids < end)
    key = torch.where(kept, ids - start, torch.full_like(ids, end - start))
    order = torch.argsort(key, stable=True)  # sorted position -> slot
    num_slots = n * k
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(num_slots, device=ids.device))
    counts = torch.zeros(end - start + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[: end - start]
    total = counts.sum()
    rows = x[order // k]
    live_sorted = torch.arange(num_slots, device=ids.device) < total
    if quant_mode == 1:
        q, s = _per_token_quant(rows)
        expanded_x = torch.where(live_sorted[:, None], q, torch.zeros_like(q))
        expanded_scale = torch.where(live_sorted, s, torch.zeros_like(s))
    else:
        expanded_x = torch.where(live_sorted[:, None], rows, torch.zeros_like(rows))
        expanded_scale = torch.zeros(num_slots, dtype=torch.float32, device=x.device)
    row_idx = torch.where(kept, pos, torch.full_like(pos, -1)).to(torch.int32)
    tokens = counts
    if active_num not in (-1, num_slots) and active_num < num_slots:
        raise NotImplementedError("active_num < N*K is not emulated")
    return expanded_x, row_idx, tokens, expanded_scale


# --- HCCL expert-parallel dispatch / combine -----------------------------------------------------


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """All ranks' `t` stacked `[W, ...]` (same shape on every rank)."""
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


def _received_order(all_ids: torch.Tensor, rank: int, local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots every rank sends to `rank`, in the receive order: by local expert, then source
    rank, then (token, k). all_ids int64 `[W, BS, K]`. Returns (src, slot, local expert) of
    each received row, int64 `[R]`."""
    w, bs, k = all_ids.shape
    flat = all_ids.reshape(w, bs * k)
    e = flat - rank * local
    mine = (e >= 0) & (e < local)
    src = torch.arange(w, device=flat.device)[:, None].expand(w, bs * k)
    slot = torch.arange(bs * k, device=flat.device)[None, :].expand(w, bs * k)
    key = (e * w + src) * (bs * k) + slot  # lexicographic (expert, src, slot)
    key = torch.where(mine, key, torch.full_like(key, torch.iinfo(torch.int64).max))
    order = torch.argsort(key.reshape(-1), stable=True)[: int(mine.sum())]
    return src.reshape(-1)[order], slot.reshape(-1)[order], e.reshape(-1)[order]


def npu_moe_distribute_dispatch(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: Any,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    expert_scales: torch.Tensor | None = None,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
) -> tuple[torch.Tensor, ...]:
    """ptaoplist_002364 (no TP, no shared experts, every rank the same BS).

    x `[BS, H]` bf16, expert_ids int32 `[BS, K]` global ids. Each (token, k) slot goes to
    the rank owning its expert (experts split evenly, rank r owns [r*L, (r+1)*L)).
    Returns (expand_x `[A, H]`, dynamic_scales `[A]`, expand_idx int32 `[BS*K]`,
    expert_token_nums int64 `[L]`, ep_recv_counts int32 `[W*L]`, tp_recv_counts int32 `[1]`,
    expand_scales float32 `[A]`), A = BS * W * min(K, L) (the documented receive bound).
    Received rows are ordered by local expert, then source rank, then token; rows past the
    received count are zeros. quant_mode 2: dynamic per-token int8 (+ fp32 dynamic_scales).
    expert_token_nums: counts (type 1) or cumsum (type 0). expand_idx and ep_recv_counts
    are the op's opaque handle for combine; here expand_idx[t*K+k] is the row of the slot
    in its destination rank's expand_x, ep_recv_counts[e*W + src] the rows per (expert, source).

    The emulation moves data with torch.distributed all_gather on `group_ep` (a
    ProcessGroup, e.g. gloo on CPU); the real op takes the HCCL communicator's name.
    """
    import torch.distributed as dist

    if global_bs not in (0, x.shape[0] * ep_world_size):
        raise NotImplementedError("only equal batch sizes on every rank are emulated (global_bs=0)")
    if dist.get_world_size(group_ep) != ep_world_size:
        raise ValueError(f"group has {dist.get_world_size(group_ep)} ranks, ep_world_size={ep_world_size}")
    bs, k = expert_ids.shape
    local = moe_expert_num // ep_world_size
    if quant_mode == 2:
        xq, xs = _per_token_quant(x)
    elif quant_mode == 0:
        xq, xs = x, torch.zeros(bs, dtype=torch.float32, device=x.device)
    else:
        raise NotImplementedError(f"quant_mode {quant_mode} is not emulated")
    w = expert_scales.float() if expert_scales is not None else torch.ones(bs, k, device=x.device)
    all_x, all_s = _gather(xq, group_ep), _gather(xs, group_ep)
    all_ids, all_w = _gather(expert_ids.to(torch.int64), group_ep), _gather(w, group_ep)
    cap = bs * ep_world_size * min(k, local)
    src, slot, e = _received_order(all_ids, ep_rank_id, local)
    r = src.numel()
    expand_x = torch.zeros(cap, x.shape[1], dtype=xq.dtype, device=x.device)
    expand_x[:r] = all_x[src, slot // k]
    dyn = torch.zeros(cap, dtype=torch.float32, device=x.device)
    dyn[:r] = all_s[src, slot // k]
    exp_scales = torch.zeros(cap, dtype=torch.float32, device=x.device)
    exp_scales[:r] = all_w.reshape(ep_world_size, bs * k)[src, slot]
    counts = torch.bincount(e, minlength=local).to(torch.int64)
    recv = torch.bincount(e * ep_world_size + src, minlength=local * ep_world_size).to(torch.int32)
    # expand_idx: where each of *my* slots lands on its destination rank.
    expand_idx = torch.empty(bs * k, dtype=torch.int32, device=x.device)
    for dst in range(ep_world_size):
        s_src, s_slot, _ = _received_order(all_ids, dst, local)
        sel = s_src == ep_rank_id
        expand_idx[s_slot[sel]] = torch.nonzero(sel).flatten().to(torch.int32)
    tokens = counts if expert_token_nums_type == 1 else torch.cumsum(counts, 0)
    tp = torch.zeros(1, dtype=torch.int32, device=x.device)
    return expand_x, dyn, expand_idx, tokens, recv, tp, exp_scales


def npu_moe_distribute_combine(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    expand_idx: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: Any,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    expand_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """ptaoplist_002363: the inverse of dispatch. `expand_scales` (dispatch's last output) is
    required on Atlas A2, as the documentation says, and so here: the emulation refuses a
    combine without it. expand_x `[A, H]` bf16 expert outputs
    (one unweighted row per received row); expert_ids / expert_scales `[BS, K]` this rank's
    routing. Returns `[BS, H]` bf16: sum over k of expert_scales[t, k] * the row of slot
    (t, k) on its expert's rank. Emulated with torch.distributed all_gather on `group_ep`."""
    if expand_scales is None:
        raise ValueError("npu_moe_distribute_combine: expand_scales is required (Atlas A2)")
    bs, k = expert_ids.shape
    local = moe_expert_num // ep_world_size
    # ep_send_counts is dispatch's ep_recv_counts handed back (ptaoplist_002363: "对应
    # npu_moe_distribute_dispatch的ep_recv_counts输出"): int32 `[W*L]` here, and the very
    # counts the emulated dispatch returned for this routing (recomputed from every rank's ids).
    _check_dtype("npu_moe_distribute_combine", "ep_send_counts", ep_send_counts, torch.int32, "ptaoplist_002363")
    if tuple(ep_send_counts.shape) != (ep_world_size * local,):
        raise ValueError(
            f"npu_moe_distribute_combine: ep_send_counts must be 1-D with ep_world_size * local_expert_num = "
            f"{ep_world_size * local} entries (dispatch's ep_recv_counts), got shape {tuple(ep_send_counts.shape)}"
        )
    all_ids = _gather(expert_ids.to(torch.int64), group_ep)
    src, _, e = _received_order(all_ids, ep_rank_id, local)
    sent = torch.bincount(e * ep_world_size + src, minlength=local * ep_world_size).to(torch.int32)
    if not torch.equal(ep_send_counts.to(sent.device), sent):
        raise ValueError(
            "npu_moe_distribute_combine: ep_send_counts differs from the ep_recv_counts npu_moe_distribute_dispatch "
            "returned for these expert_ids (combine returns tokens along dispatch's path)"
        )
    all_y = _gather(expand_x, group_ep)  # [W, A, H]
    dst = expert_ids.to(torch.int64).reshape(-1) // local
    rows = all_y[dst, expand_idx.to(torch.int64)].float()
    out = (rows * expert_scales.float().reshape(-1, 1)).view(bs, k, expand_x.shape[-1]).sum(1)
    return out.to(expand_x.dtype)


# --- DeepEP-Ascend fused_deep_moe ------------------------------------------------------------------

FUSED_DEEP_MOE = 1
DISPATCH_FFN_COMBINE = 2
W13_TILE = 128  # FUSED_DEEP_MOE's gmm1 weight: [gate; up] interleaved in tiles of 64 + 64 columns


@dataclass(frozen=True)
class LowLatencyBuffer:
    """Stand-in for the DeepEP-Ascend low-latency `Buffer` fused_deep_moe runs on. The real one
    is sized at creation for `num_max_dispatch_tokens_per_rank` tokens per rank
    (`get_low_latency_rdma_size_hint`), the value fused_deep_moe is later told ("used for
    buffer/memory allocation", FUSED_DEEP_MOE doc); the stand-in records it so fused_deep_moe
    can refuse a value the buffer was not created for."""

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_local_experts: int
    num_ranks: int = 1


def low_latency_buffer(group: Any, max_tokens: int, hidden: int, num_experts: int, local: int) -> LowLatencyBuffer:
    """The emulated counterpart of `VendorOps.low_latency_buffer` (same arguments); `group` may
    be None (one rank)."""
    if group is None:
        ranks = 1
    else:
        import torch.distributed as dist

        ranks = dist.get_world_size(group)
    return LowLatencyBuffer(max_tokens, hidden, num_experts, local, ranks)


def expected_max_dispatch_tokens(buffer: LowLatencyBuffer, fuse_mode: int, top_k: int) -> int:
    """num_max_dispatch_tokens_per_rank as moehal_npu passes it for a buffer made for
    `buffer.num_max_dispatch_tokens_per_rank` tokens per rank: that value for FUSED_DEEP_MOE
    (tokens each rank dispatches); for DISPATCH_FFN_COMBINE the rows one rank may receive
    (FUSED_DEEP_MOE doc: max_output_size), tokens * top_k * ranks, the value sgl-kernel-npu's
    test of the mode (tests/python/deepep/test_dispatch_ffn_combine.py) passes. (Until session
    54 moehal passed tokens * ranks * min(top_k, local experts): a tighter bound, which the
    kernel's own users never pass.)"""
    t = buffer.num_max_dispatch_tokens_per_rank
    if fuse_mode == DISPATCH_FFN_COMBINE:
        return t * buffer.num_ranks * top_k
    return t


def unpermute_w13_columns(t: torch.Tensor, tile: int = W13_TILE) -> torch.Tensor:
    """Inverse of the FUSED_DEEP_MOE gmm1 column permute on the last dim: within every
    `tile` columns the first half belongs to gate and the second to up; returns `[gate | up]`."""
    *dims, n = t.shape
    v = t.reshape(*dims, n // tile, 2, tile // 2)
    return v.transpose(-3, -2).reshape(*dims, n)


def fused_deep_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    gmm1_permuted_weight: torch.Tensor,
    gmm1_permuted_weight_scale: torch.Tensor,
    gmm2_weight: torch.Tensor,
    gmm2_weight_scale: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    quant_mode: int = 1,
    fuse_mode: int = FUSED_DEEP_MOE,
    buffer: LowLatencyBuffer | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP-Ascend `Buffer.fused_deep_moe` (doc/FUSED_DEEP_MOE.md), one rank (EP world 1).

    x `[bs, H]` bf16; topk_idx `[bs, K]` (-1 = not dispatched); topk_weights fp32 `[bs, K]`.
    Weights: gmm1 `[E, H, 2I]`, gmm1 scale `[E, 2I]`, gmm2 scale `[E, H]`.
    FUSED_DEEP_MOE (1): gmm1 columns (and its scale) are tile-permuted (`unpermute_w13_columns`),
    gmm2 `[E, H, I]` as the checkpoint holds it (the documentation's example and the vendor's
    test cast it to NZ untransposed), scales float32; int8 (quant_mode 1): the op's
    definition takes INT8 weights only.
    DISPATCH_FFN_COMBINE (2): gmm1 unpermuted, gmm2 `[E, I, H]`, scales int64 holding the
    float32 bit pattern (sign-extended), int8 only.
    Math: dynamic per-token int8 x -> gmm1 -> dequant -> SwiGLU (silu(gate) * up) -> dynamic
    per-token int8 -> gmm2 -> dequant -> bf16 per row -> weighted sum over k -> bf16.
    Returns (out `[bs, H]` bf16, a count moehal_npu discards: ep_recv_count int32
    `[local experts x ranks]` for FUSED_DEEP_MOE on A3, expert_token_nums `[local experts]` for
    DISPATCH_FFN_COMBINE; here int32 `[local experts]` rows per local expert).

    Operand checks (the documented argument list, `Buffer.fused_deep_moe` docstring and
    FUSED_DEEP_MOE doc): topk_idx int64 (the Python wrapper then casts it to int32 for the
    kernel), topk_weights float32. With `buffer` (the emulated low-latency buffer),
    num_max_dispatch_tokens_per_rank must be what that buffer was created for
    (`expected_max_dispatch_tokens`).
    """
    op = "DeepEP-Ascend fused_deep_moe"
    _check_dtype(op, "topk_idx", topk_idx, torch.int64, "Buffer.fused_deep_moe docstring")
    _check_dtype(op, "topk_weights", topk_weights, torch.float32, "Buffer.fused_deep_moe docstring")
    bs, k = topk_idx.shape
    if buffer is not None:
        want = expected_max_dispatch_tokens(buffer, fuse_mode, k)
        if num_max_dispatch_tokens_per_rank != want:
            raise ValueError(
                f"{op}: num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, but the low-latency "
                f"buffer was created for {buffer.num_max_dispatch_tokens_per_rank} tokens per rank, which "
                f"fuse_mode {fuse_mode} takes as {want}"
            )
    if bs > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"{bs} tokens exceed num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
    e_loc = gmm1_permuted_weight.shape[0]
    if e_loc != num_experts:
        raise NotImplementedError("the emulation covers one rank holding every expert (EP world size 1)")
    if fuse_mode == DISPATCH_FFN_COMBINE:
        if quant_mode != 1:
            raise ValueError("DISPATCH_FFN_COMBINE is INT8 only (quant_mode=1)")
        if bool((topk_idx < 0).any()):  # the vendor's test of this mode: "topk=-1 is not supported"
            raise ValueError("DISPATCH_FFN_COMBINE does not take -1 top-k ids")
        s1 = gmm1_permuted_weight_scale.to(torch.int32).view(torch.float32)
        s2 = gmm2_weight_scale.to(torch.int32).view(torch.float32)
        w1 = gmm1_permuted_weight
    elif fuse_mode == FUSED_DEEP_MOE:
        if quant_mode != 1 or gmm1_permuted_weight.dtype != torch.int8:
            raise ValueError("FUSED_DEEP_MOE takes INT8 weights (quant_mode=1); its op definition has no BF16 form")
        s1 = unpermute_w13_columns(gmm1_permuted_weight_scale.float())
        s2 = gmm2_weight_scale.float()
        w1 = unpermute_w13_columns(gmm1_permuted_weight)
        gmm2_weight = gmm2_weight.transpose(1, 2)  # [E, H, I] -> the [E, I, H] the math below reads
    else:
        raise NotImplementedError(f"fuse_mode {fuse_mode} is not emulated")
    ids = topk_idx.to(torch.int64)
    valid = ids >= 0
    out = torch.zeros(bs, x.shape[1], dtype=torch.float32, device=x.device)
    recv = torch.zeros(e_loc, dtype=torch.int32, device=x.device)
    for e in range(e_loc):
        tok, kk = torch.nonzero(valid & (ids == e), as_tuple=True)
        recv[e] = tok.numel()
        if not tok.numel():
            continue
        xe = x[tok]
        if quant_mode == 1:
            q, s = _per_token_quant(xe)
            h = (q.double() @ w1[e].double()) * s.double()[:, None] * s1[e].double()
            gate, up = h.float().chunk(2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
            aq, as_ = _per_token_quant(a)
            y = (aq.double() @ gmm2_weight[e].double()) * as_.double()[:, None] * s2[e].double()
        else:
            h = (xe.float() @ w1[e].float()).to(x.dtype)
            gate, up = h.float().chunk(2, dim=-1)
            a = (torch.nn.functional.silu(gate) * up).to(x.dtype)
            y = a.float() @ gmm2_weight[e].float()
        y = y.to(x.dtype).float()
        out.index_add_(0, tok, y * topk_weights[tok, kk].float()[:, None])
    return out.to(x.dtype), recv
