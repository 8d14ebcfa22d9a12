"""A test double of DeepEP's legacy `deep_ep.Buffer` (v2.1.0), for ranks that are threads of one
process: the calls, shapes and semantics moehal's DeepEP runners rely on, in plain torch.

What it mirrors (DeepEP's README and `deep_ep/buffers/legacy.py`, summarized in
shared/reference/vendor-apis.md section 2):
- normal mode: `get_dispatch_layout`; `dispatch` sends each token once to every rank holding one
  of its experts, rank-ordered, with its top-k ids made local (-1: another rank's expert) and
  its weights; `combine` is an **unweighted** sum over the ranks a token went to;
- low latency: `low_latency_dispatch` packs each local expert's rows as a prefix of
  `[E_local, ranks * T_max, H]` with their count (`masked_m`), bf16 or fp8 in 1x128 groups with
  fp32 scales, column-major in the last two dims (power-of-two with `round_scale`);
  `low_latency_combine` is a **weighted** sum by the original ids and weights.

It exercises moehal's runners (their formats, the permute into the contiguous layout, the
weighted and unweighted combines, buffer sizing) on the CPU. It proves nothing about DeepEP
itself, which no machine here can run (docs/backends/cuda.md).
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

TOPK_IDX_T = torch.int64  # what `deep_ep.topk_idx_t` names in the releases that define it


class World:
    """The ranks' rendezvous. One rank computes at a time (`lock`: Triton's interpreter is not
    thread-safe); a collective posts this rank's inputs, waits for every rank's, reads them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.posts: list[Any] = [None] * size
        self.lock = threading.Lock()

    def exchange(self, rank: int, item: Any) -> list[Any]:
        # what a rank sends is copied as it is sent (moved to the other GPUs): the ranks here
        # share one process, and so the process-wide workspaces a later rank overwrites
        self.posts[rank] = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in item)
        self.lock.release()
        try:
            self.barrier.wait(timeout=120)
            items = list(self.posts)
            self.barrier.wait(timeout=120)
        finally:
            self.lock.acquire()
        return items

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on one thread per rank; their results, or the first rank's error."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            with self.lock:
                try:
                    results[rank] = fn(rank)
                except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                    errors.append(exc)
                    self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class Group:
    """What the runners use of a process group: rank() and size()."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self._rank = world, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size


class Config:
    # sizes that grow with the traffic, as DeepEP's do (the numbers are the double's own)
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks


def _quantize(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 groups: scale amax / 448 (a power of two with round_scale), e4m3 values."""
    g = x.float().unflatten(-1, (-1, 128))
    scale = g.abs().amax(-1).clamp_min(1e-12) / 448.0
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale[..., None]).clamp(-448, 448).flatten(-2).to(torch.float8_e4m3fn)
    return q, scale


class Buffer:
    # every buffer made, and the live ones: DeepEP's NVSHMEM set-up fails on a second live
    # low-latency buffer in a process (a rank here)
    made: list[Buffer] = []
    live: weakref.WeakSet[Buffer] = weakref.WeakSet()

    def __init__(self, group: Group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, **kwargs: Any) -> None:
        self.world, self.rank, self.size = group.world, group.rank(), group.size()
        self.low_latency_mode = kwargs.get("low_latency_mode", False)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.num_qps_per_rank = kwargs.get("num_qps_per_rank", 1)
        if self.low_latency_mode:
            twins = [b for b in Buffer.live if b.low_latency_mode and b.world is self.world and b.rank == self.rank]
            assert not twins, "a second low-latency buffer in one process (DeepEP's NVSHMEM team split asserts)"
        Buffer.made.append(weakref.proxy(self))
        Buffer.live.add(self)

    @staticmethod
    def get_low_latency_rdma_size_hint(t_max: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return t_max * hidden * num_ranks

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    # --- normal mode ---------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, **kwargs: Any) -> tuple:
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous(), "DeepEP asserts contiguous topk_idx"
        e_loc = num_experts // self.size
        owner = torch.where(topk_idx >= 0, topk_idx // e_loc, -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.size)], dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0].flatten(), minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(
        self,
        x: torch.Tensor,
        handle: Any = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        **kwargs: Any,
    ) -> tuple:
        assert topk_idx is not None and topk_weights is not None and is_token_in_rank is not None
        assert num_tokens_per_expert is not None
        assert x.dtype == torch.bfloat16, "DeepEP's normal dispatch takes bf16 x (or an fp8 tuple)"
        assert topk_idx.dtype == TOPK_IDX_T, "top-k ids in deep_ep.topk_idx_t"
        assert x.is_contiguous() and topk_idx.is_contiguous() and topk_weights.is_contiguous(), (
            "DeepEP asserts contiguous x, topk_idx and topk_weights"
        )
        e_loc = num_tokens_per_expert.numel() // self.size
        lo = self.rank * e_loc
        posts = self.world.exchange(self.rank, (x, topk_idx, topk_weights, is_token_in_rank))
        xs, ids, ws, sources = [], [], [], []
        for src, (sx, sids, sw, s_in) in enumerate(posts):
            for t in torch.nonzero(s_in[:, self.rank]).flatten().tolist():
                local = (sids[t] >= lo) & (sids[t] < lo + e_loc)
                xs.append(sx[t])
                ids.append(torch.where(local, sids[t] - lo, -1))
                ws.append(sw[t])
                sources.append((src, t))
        h, k = x.shape[1], topk_idx.shape[1]
        recv_x = torch.stack(xs) if xs else x.new_zeros(0, h)
        recv_ids = torch.stack(ids) if ids else topk_idx.new_zeros(0, k)
        recv_w = torch.stack(ws) if ws else topk_weights.new_zeros(0, k)
        counts = [int((recv_ids == e).sum()) for e in range(e_loc)]
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        return recv_x, recv_ids, recv_w, counts, (sources, x.shape[0]), None

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: Any = None, **kwargs: Any) -> tuple:
        sources, _ = handle
        posts = self.world.exchange(self.rank, (x, sources))
        _, my_tokens = handle
        out = torch.zeros(my_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        for rx, rsources in posts:
            for i, (src, t) in enumerate(rsources):
                if src == self.rank:
                    out[t] += rx[i].float()
        return out.to(x.dtype), None, None

    # --- low latency -----------------------------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        **kwargs: Any,
    ) -> tuple:
        assert not use_ue8m0 or round_scale, "use_ue8m0 requires round_scale"
        assert not use_ue8m0, "the double sends fp32 scales only"
        assert x.dtype == torch.bfloat16, "DeepEP's low-latency dispatch asserts bf16 x"
        assert topk_idx.dtype == TOPK_IDX_T, "top-k ids in deep_ep.topk_idx_t"
        assert x.is_contiguous() and topk_idx.is_contiguous(), "DeepEP asserts contiguous x and topk_idx"
        t_max, e_loc = num_max_dispatch_tokens_per_rank, num_experts // self.size
        assert x.shape[0] <= t_max, "more tokens than num_max_dispatch_tokens_per_rank"
        posts = self.world.exchange(self.rank, (x, topk_idx))
        # DeepEP allocates its receive buffer once (torch::empty) and rows past a count keep what
        # they held: NaN here, so experts that let padding rows reach live ones show
        recv = x.new_full((e_loc, self.size * t_max, x.shape[1]), float("nan"))
        count = torch.zeros(e_loc, dtype=torch.int32, device=x.device)
        where: dict[tuple[int, int], tuple[int, int, int]] = {}  # (expert, row) -> (source rank, token, k)
        for src, (sx, sids) in enumerate(posts):
            for t in range(sx.shape[0]):
                for k, g in enumerate(sids[t].tolist()):
                    if g >= 0 and g // e_loc == self.rank:
                        e = g % e_loc
                        row = int(count[e])
                        recv[e, row] = sx[t]
                        where[(e, row)] = (src, t, k)
                        count[e] += 1
        handle = (where, x.shape[0])
        if not use_fp8:
            return recv, count, handle, None, None
        q, s = _quantize(recv, round_scale)
        s = s.transpose(1, 2).contiguous().transpose(1, 2)  # column-major in the last two dims
        return (q, s), count, handle, None, None

    def low_latency_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any, **kwargs: Any
    ) -> tuple:
        assert topk_idx.is_contiguous() and topk_weights.is_contiguous(), "DeepEP asserts contiguous top-k"
        where, my_tokens = handle
        posts = self.world.exchange(self.rank, (x, where))
        out = torch.zeros(my_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
        for rx, rwhere in posts:
            for (e, row), (src, t, k) in rwhere.items():
                if src == self.rank:
                    out[t] += topk_weights[t, k].float() * rx[e, row].float()
        return out.to(torch.bfloat16), None, None


def module() -> types.ModuleType:
    """A `deep_ep` module made of this double, for `sys.modules`."""
    m = types.ModuleType("deep_ep")
    m.Buffer = Buffer  # type: ignore[attr-defined]
    m.topk_idx_t = TOPK_IDX_T  # type: ignore[attr-defined]
    m.__moehal_test_double__ = True  # type: ignore[attr-defined]
    return m
