"""Expert parallelism over `torch.distributed`: the generic EP dispatcher.

Works with any process-group backend that implements `all_to_all_single` (NCCL, RCCL, HCCL,
gloo, ...). Vendor fast paths (DeepEP on CUDA, HCCL dispatch/combine ops on Ascend) are
separate dispatchers with higher priority; this one is their reference and the fallback.

Semantics. Every rank of the group calls the layer with its own tokens `[T_r, H]` (T_r may
be 0) and *global* top-k ids. The experts are sharded contiguously: rank r owns experts
`[r * E_local, (r + 1) * E_local)` (`MoEConfig.ep_rank` / `ep_size`), and loads only those.

Dispatch, per forward:
1. Each token goes once to every rank that owns at least one of its top-k experts (a token
   whose k experts sit on 3 ranks is sent 3 times, not k times). The row sent is the
   activation (quantized first when the experts consume fp8 1x128 groups or int8 per token,
   so the wire carries 1 byte per element plus its scales) followed by the token's top-k ids
   (int32) and router weights (fp32). Rows are packed as bytes, so any backend can move
   fp8 (gloo has no float8 type).
2. Count exchange: each rank sends every peer the number of rows it will send it
   (`all_to_all_single` of `[ep_size]` int64) and reads both count vectors back to the host
   (`.tolist()`). **This is the only host sync** of dispatch + combine: `all_to_all_single`
   needs its split sizes on the host, and the received row count sizes the receive buffer.
3. Payload exchange: one `all_to_all_single` of the packed rows.
4. The receiving rank lays the rows out in the format its experts consume, exactly like the
   single-device reference dispatcher does for local tokens: STANDARD (received tokens,
   local ids, -1 for experts on other ranks), CONTIGUOUS (expert-sorted, aligned segments)
   or MASKED (`[E_local, max_m, H]`). MASKED uses `max_m = max_tokens * ep_size` when
   `MoEConfig.max_tokens` is set (a static worst case: one expert can receive every token of
   every rank once) and otherwise the received row count of this call rounded up to a power
   of two (also a bound, since a token's ids are distinct; a few shapes over a serving loop,
   where experts keep buffers per shape).

Combine reverses it: the receiving rank reduces each received token over its local k slots
(weighted by the router weights, in float32; STANDARD experts already return that sum),
rounds the partial sum to `config.dtype` and sends it back with one `all_to_all_single` (one
row per (token, rank) pair, like DeepEP's normal mode). The source rank sums the partial
sums of the ranks in float32 in a fixed order (deterministic: a gather, no atomics), applies
`routed_scaling_factor` and casts to `config.dtype`.

Precision. The result differs from the single-process layer only by the rounding of each
rank's partial sum to `config.dtype` and by the order of the float32 sum over ranks.

Not graph-capturable (the count exchange reads device memory on the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from moehal import permute
from moehal.capability import Decision, accept, decline
from moehal.errors import ConfigError
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    ScaleKind,
    StandardInput,
    StandardOutput,
)
from moehal.interfaces import BuildRequest, Dispatcher, DispatchRunner
from moehal.quant.activation import check_core_format, quantize_activation, scale_kind_dtype
from moehal.routing import TopK

_U8 = torch.uint8


def _group_info(group: Any) -> tuple[int, int]:
    """(rank, world size) of this process in `group`; raises if torch.distributed is unusable."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def check_process_group(req: BuildRequest) -> Decision:
    """The expert-parallel group against the config: its size must be `ep_size` and this
    process's rank in it `ep_rank`, or the experts this rank loads are not the ones its peers
    send it tokens for (wrong results, no error). For every dispatcher that moves tokens over
    `req.process_group`, vendors' included."""
    c = req.config
    try:
        rank, world = _group_info(req.process_group)
    except (RuntimeError, ValueError) as exc:
        return decline(f"torch.distributed is not usable: {exc}", "parallel")
    if world != c.ep_size:
        return decline(f"the process group has {world} ranks, MoEConfig.ep_size is {c.ep_size}", "parallel")
    if rank != c.ep_rank:
        return decline(
            f"this process is rank {rank} of the group, MoEConfig.ep_rank is {c.ep_rank}; "
            "build each rank's config with its group rank",
            "parallel",
        )
    return accept(f"EP over {world} ranks", "parallel")


# Config fields that may differ between the ranks of one EP layer: each rank's own position,
# and its own bound on the tokens it brings to one forward
_PER_RANK_FIELDS = frozenset({"ep_rank", "max_tokens"})


def what_ranks_must_share(req: BuildRequest, wire: dict[str, str]) -> dict[str, str]:
    """What every rank of one expert-parallel layer must agree on, as text: the config's math
    (all but `_PER_RANK_FIELDS`), the quant scheme, and `wire` (the selected dispatcher and the
    formats it sends)."""
    c = req.config
    shared = {f.name: repr(getattr(c, f.name)) for f in fields(c) if f.name not in _PER_RANK_FIELDS}
    return {**shared, "quant": req.quant.name, **wire}


def check_ranks_agree(req: BuildRequest, wire: dict[str, str]) -> None:
    """Raise `ConfigError` on every rank of `req.process_group` unless all ranks built this layer
    with the same `what_ranks_must_share`. One `all_gather_object` at build, none per forward.

    Why: a dispatch sizes its rows, routes ids and runs its experts from each rank's own
    config. Ranks that disagree (another top_k, hidden size, dtype, quant scheme, expert count
    or activation; or another dispatcher or wire format chosen) either abort the process inside
    the collective (gloo: "Received data size doesn't match expected size", uncatchable) or
    compute silently wrong rows (session 44's EP audit). Every rank sees every rank's answer,
    so all of them raise."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"MoEConfig.ep_size is {req.config.ep_size} and a process group was given, but torch.distributed is "
            "not initialized: call torch.distributed.init_process_group first"
        )
    mine = what_ranks_must_share(req, wire)
    world = dist.get_world_size(req.process_group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=req.process_group)
    differ = []
    for rank, theirs in enumerate(everyone):
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if keys:
            differ.append(f"rank {rank}: " + ", ".join(f"{k}={theirs.get(k)} (here {mine.get(k)})" for k in keys))
    if differ:
        raise ConfigError(
            f"the ranks of this expert-parallel layer disagree (rank {req.config.ep_rank} of {world}): "
            + "; ".join(differ)
            + ". Build every rank's layer from one config, changing only ep_rank (and max_tokens), "
            "with the same quant scheme, backend and layout"
        )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[N, ...]` -> uint8 `[N, bytes per row]` (a view where possible)."""
    per_row = math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:
        return torch.empty(t.shape[0], per_row, dtype=_U8, device=t.device)
    return t.contiguous().reshape(t.shape[0], -1).view(_U8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 `[..., nbytes]` -> dtype `[..., *shape]` (copies to get a contiguous slice)."""
    lead = b.shape[:-1]
    return b.contiguous().view(dtype).reshape(*lead, *shape)


@dataclass(frozen=True)
class _Wire:
    """Byte layout of one dispatched row: [activation | scales | ids int32 | weights fp32]."""

    hidden: int
    scales: int
    top_k: int

    @property
    def payload(self) -> int:  # activation + scales: what the experts see
        return self.hidden + self.scales

    @property
    def row(self) -> int:
        return self.payload + 8 * self.top_k


@dataclass(frozen=True)
class _Handle:
    num_tokens: int
    send_splits: list[int]  # rows this rank sent to each rank (= rows it gets back in combine)
    recv_splits: list[int]  # rows this rank received from each rank
    combine_map: torch.Tensor  # int64 [T, K]: returned row of slot (t, k), or n_send (a zero row)
    recv_weights: torch.Tensor  # fp32 [R, K] router weights of the received tokens
    idx: permute.SlotIndex | None
    slot_row: torch.Tensor | None


class TorchDistributedDispatchRunner(DispatchRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        c = req.config
        self.fmt, self.group = fmt, req.process_group
        rank, world = _group_info(self.group)
        if world != c.ep_size or rank != c.ep_rank:
            raise ConfigError(
                f"process group has rank {rank} of {world}, but MoEConfig says ep_rank={c.ep_rank} of "
                f"ep_size={c.ep_size}; build each rank's config with its own group rank"
            )
        self.world, self.rank = world, rank
        self.top_k, self.num_local, self.expert_start = c.top_k, c.num_local_experts, c.local_expert_start
        self.num_experts = c.num_experts
        self.dtype, self.hidden_size, self.max_tokens = c.dtype, c.hidden_size, c.max_tokens
        self.scale = c.routed_scaling_factor
        self.weight_on_input = c.apply_router_weight_on_input
        self.q_dtype = scale_kind_dtype(fmt.scales) or c.dtype
        h = c.hidden_size
        grouped = fmt.scales in (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0)
        self.scale_shape: tuple[int, ...] = (math.ceil(h / 128),) if grouped else ()  # per token: one scale
        n_scales = self.n_scales = math.prod(self.scale_shape) if fmt.is_quantized else 0
        elem = torch.empty((), dtype=self.q_dtype).element_size()
        self.wire = _Wire(hidden=h * elem, scales=4 * n_scales, top_k=c.top_k)

    # --- collectives --------------------------------------------------------------------------
    def _all_to_all(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty(sum(recv), rows.shape[1], dtype=rows.dtype, device=rows.device)
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self.group)
        return out

    def _exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        import torch.distributed as dist

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        both = torch.stack([send_counts, recv_counts]).tolist()  # the one host sync (split sizes)
        return both[0], both[1]

    # --- dispatch -----------------------------------------------------------------------------
    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[Any, _Handle]:
        t, k, w, dev = hidden.shape[0], self.top_k, self.world, hidden.device
        weights = topk.weights.float()
        if self.weight_on_input:  # top_k == 1 (checked by MoEConfig)
            hidden = (hidden.float() * weights).to(hidden.dtype)
            weights = torch.ones_like(weights)
        ids = topk.ids.to(torch.int64)
        # A -1 slot (MoEConfig.topk_padding) goes nowhere and combines as zero; so does an id past
        # the experts, which only unchecked input (validate=False) can hold: no rank owns it.
        pad = (ids < 0) | (ids >= self.num_experts)
        dst = torch.where(pad, w, ids // self.num_local)  # [T, K] owning rank of each slot; w: none
        # A token goes once to each rank it needs: keep the first slot of every destination.
        dup = (dst[:, :, None] == dst[:, None, :]).tril(-1).any(-1) if k > 1 else torch.zeros_like(dst, dtype=bool)
        unsent = dup | pad
        key = torch.where(unsent, w, dst).reshape(-1)  # [S]; w = not sent
        send_counts = torch.bincount(key, minlength=w + 1)[:w]
        send_splits, recv_splits = self._exchange_counts(send_counts)
        n_send = sum(send_splits)
        order = torch.argsort(key, stable=True)  # sent slots first, grouped by destination rank
        pos = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=dev))
        combine_map = torch.where(unsent.reshape(-1), torch.full_like(pos, n_send), pos).view(t, k)
        send_token = order[:n_send] // k

        q, s = quantize_activation(hidden, self.fmt.scales)
        parts = [_as_bytes(q)]
        if s is not None:
            parts.append(_as_bytes(s.float().reshape(t, self.n_scales)))
        parts += [_as_bytes(ids.to(torch.int32)), _as_bytes(weights)]
        packed = torch.cat(parts, dim=1)[send_token]
        recv = self._all_to_all(packed, send_splits, recv_splits)

        r, wire = recv.shape[0], self.wire
        payload = recv[:, : wire.payload]
        recv_ids = _from_bytes(recv[:, wire.payload : wire.payload + 4 * k], torch.int32, (k,))
        recv_w = _from_bytes(recv[:, wire.payload + 4 * k :], torch.float32, (k,))
        layout = self.fmt.layout
        if layout is Layout.STANDARD:
            hq, hs = self._unpack(payload)
            local_ids = permute.local_topk_ids(recv_ids, self.expert_start, self.num_local)
            handle = _Handle(t, send_splits, recv_splits, combine_map, recv_w, None, None)
            return StandardInput(hq, hs, local_ids, recv_w), handle
        idx = permute.index_slots(recv_ids, self.expert_start, self.num_local)
        if layout is Layout.MASKED:
            # without max_tokens: the received row count, rounded up to a power of two, so a
            # serving loop meets a few buffer shapes (experts keep workspaces per shape), not one per call
            max_m = self.max_tokens * w if self.max_tokens is not None else (1 << (r - 1).bit_length() if r else 0)
            max_m = permute.round_up(max_m, self.fmt.row_alignment)
            xm, masked_m = permute.to_masked(payload, idx, max_m)
            hq, hs = self._unpack(xm)
            per_row = max(1, -(-k // w))  # hint: local slots per received token, roughly
            expected_m = max(1, -(-r * per_row // self.num_local))
            handle = _Handle(t, send_splits, recv_splits, combine_map, recv_w, idx, None)
            return MaskedInput(hq, hs, masked_m, expected_m, r * k), handle
        xc, row_expert, seg_start, slot_row = permute.to_contiguous(payload, idx, self.fmt.row_alignment)
        hq, hs = self._unpack(xc)
        handle = _Handle(t, send_splits, recv_splits, combine_map, recv_w, idx, slot_row)
        return ContiguousInput(hq, hs, row_expert, idx.counts, seg_start), handle

    def _unpack(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 `[..., payload bytes]` -> (activation `[..., H]`, scales or None)."""
        hb = self.wire.hidden
        hq = _from_bytes(payload[..., :hb], self.q_dtype, (self.hidden_size,))
        if not self.fmt.is_quantized:
            return hq, None
        return hq, _from_bytes(payload[..., hb:], torch.float32, self.scale_shape)

    # --- combine ------------------------------------------------------------------------------
    def combine(self, expert_out: Any, handle: _Handle) -> torch.Tensor:
        scale = self.scale
        if isinstance(expert_out, StandardOutput):
            partial = expert_out.hidden
            scale = 1.0 if expert_out.scaled else scale  # each rank's share is already scaled
        elif isinstance(expert_out, MaskedOutput):
            assert handle.idx is not None
            partial = permute.from_masked(expert_out.hidden, handle.idx, handle.recv_weights)
        elif isinstance(expert_out, ContiguousOutput):
            assert handle.idx is not None and handle.slot_row is not None
            partial = permute.from_contiguous(expert_out.hidden, handle.idx, handle.slot_row, handle.recv_weights)
        else:
            raise TypeError(f"torch_distributed combine cannot take {type(expert_out).__name__}")
        wire = _as_bytes(partial.to(self.dtype))
        back = self._all_to_all(wire, handle.recv_splits, handle.send_splits)
        rows = _from_bytes(back, self.dtype, (self.hidden_size,)).float()
        rows = torch.cat([rows, rows.new_zeros(1, self.hidden_size)])  # row n_send: the zero row
        out = rows[handle.combine_map].sum(1)  # fixed order over k: deterministic
        if scale != 1.0:
            out = out * scale
        return out.to(self.dtype)


class TorchDistributedDispatcher(Dispatcher):
    """Expert parallelism through `torch.distributed.all_to_all_single`, any backend."""

    name = "torch_distributed"
    priority = 5
    description = "expert parallelism over torch.distributed all_to_all_single (NCCL, RCCL, HCCL, gloo)"
    graph_capturable = False  # the count exchange is read on the host
    drops_padding_ids = True  # a -1 slot is sent nowhere (`dispatch`)
    same_wire_for_every_layout = True  # rows go out token-major; the layout is made on arrival

    def check_parallel(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.ep_size == 1:
            return decline(
                "ep_size is 1: no tokens move between processes (the local dispatcher serves it)", "parallel"
            )
        if req.process_group is None:
            return decline(
                f"ep_size={c.ep_size} but no process group was given: pass MoELayer(..., process_group=group) "
                "(torch.distributed.group.WORLD for the default group)",
                "parallel",
            )
        return check_process_group(req)

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        return check_core_format(fmt, req.config.dtype)  # quantizes before sending; scales travel with the rows

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return TorchDistributedDispatchRunner(req, fmt)
