"""DeepEP expert-parallel dispatchers (deep_ep.Buffer, legacy NVSHMEM API).

- `cuda.deepep_ll` (low latency): MASKED `[E_local, R*T_max, H]` + masked_m, BF16 or FP8 1x128
  (round_scale for experts that want power-of-two scales); combine is DeepEP's weighted sum.
  Static shapes, no host sync: graph capturable.
- `cuda.deepep` (normal): tokens arrive rank-ordered; they are permuted on the receiving rank
  into the CONTIGUOUS layout with our Triton kernels and combined back (weighted) before
  DeepEP's unweighted combine. DeepEP's normal dispatch reports counts on the host, so this
  path is not graph capturable.

The library's limits are checked at layer build with a reason (low-latency hidden sizes,
top-k <= 11, FP8 hidden % 512, rows % 4 (FP8: % 128), T_max <= 1024 and vs. NVSHMEM_QP_DEPTH,
rank counts).

Every layer of a process shares one `deep_ep.Buffer` per (process group, mode)
(`shared_buffer`), as SGLang's `DeepEPBuffer` and DeepEP's own README keep one: a second
low-latency buffer in a process fails DeepEP's NVSHMEM set-up, and each buffer is sized for a
whole layer's traffic (about 1.8 GiB per rank for a DeepSeek-V3 low-latency layer).

NOT RUN here: sgl-deep-ep pins a torch release other than the device's (see
docs/backends/cuda.md) and needs several GPUs with NVSHMEM.
"""

from __future__ import annotations

import gc
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from moehal.capability import Decision, accept, decline
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    ScaleKind,
)
from moehal.hardware import module_available, package_version
from moehal.interfaces import BuildRequest, Dispatcher, DispatchRunner
from moehal.kernels.host import dense_aligned
from moehal.routing import TopK
from moehal_cuda.support import sm_decision

LL_HIDDEN = (2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)  # csrc/kernels/legacy/launch.cuh SWITCH_HIDDEN
LL_MAX_TOPK = 11
# Builds before DeepEP's v2 source layout (deep_ep/buffers/legacy.py, which sgl-deep-ep shares)
# lack these: v1.2.1's SWITCH_HIDDEN has neither 3072 nor 3584, and its low-latency kNumMaxTopK is
# 9. Their kernels assert at the first dispatch ("Unsupported hidden"), so the build is asked first.
LL_HIDDEN_SINCE_V2 = (3072, 3584)
LL_MAX_TOPK_BEFORE_V2 = 9
# The low-latency dispatch counts arrivals against FINISHED_SUM_TAG (1024): SGLang asserts
# num_max_dispatch_tokens_per_rank <= 1024 for it
LL_MAX_TOKENS = 1024
# sgl-deep-ep's low-latency FP8 kernel places each expert's scales at a stride of
# align(ranks * T_max, 128) rows while the host allocates ranks * T_max: equal only when the
# rows are a multiple of 128 (upstream DeepEP strides by ranks * T_max itself)
LL_FP8_ROW_ALIGNMENT = 128
DEFAULT_CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)  # normal mode's dispatch configs
NVL_PEERS = 8  # deep_ep.Buffer asserts ranks < 8 or a multiple of 8 (NUM_MAX_NVL_PEERS)
# Both modes take the layer's hidden states as they are, and DeepEP's kernels read bf16 (low
# latency asserts it; normal mode sizes its NVLink buffers for 2-byte elements).
_BF16_ONLY = "DeepEP sends bf16 hidden states; the layer dtype is {dtype}"


def _topk_idx_dtype() -> torch.dtype:
    """The dtype DeepEP takes top-k ids in: `deep_ep.topk_idx_t` where the release names it
    (typically int64), else int64."""
    import deep_ep

    return getattr(deep_ep, "topk_idx_t", torch.int64)


# What each mode calls on `deep_ep.Buffer`: a release that lacks one is declined at build, not
# met as an AttributeError at the first forward.
LL_CALLS = ("get_low_latency_rdma_size_hint", "low_latency_dispatch", "low_latency_combine")
NORMAL_CALLS = ("get_dispatch_config", "get_dispatch_layout", "dispatch", "combine")
# `low_latency_dispatch(round_scale=...)` (power-of-two scales) came with DeepEP PR #206 (June 2025)
ROUND_SCALE_SINCE = "DeepEP PR #206, June 2025"


def _deep_ep_version() -> str:
    return package_version("sgl-deep-ep") or package_version("deep-ep") or "(version unknown)"


def _deep_ep_v2_layout() -> bool | None:
    """Whether the installed deep_ep has DeepEP's v2 layout (`deep_ep.buffers.legacy`); None
    when deep_ep does not import (the library check says why)."""
    import importlib

    try:
        importlib.import_module("deep_ep")
    except Exception:  # noqa: BLE001 - a broken install is `_deep_ep_decision`'s to report
        return None
    try:
        importlib.import_module("deep_ep.buffers.legacy")
    except Exception:  # noqa: BLE001
        return False
    return True


def _deep_ep_decision(calls: tuple[str, ...]) -> Decision:
    if not module_available("deep_ep"):
        return decline("deep_ep is not installed (DeepEP; sgl-deep-ep wheels pin a torch release)", "libraries")
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001
        return decline(f"deep_ep failed to import: {type(exc).__name__}: {exc}", "libraries")
    missing = [n for n in calls if not callable(getattr(getattr(deep_ep, "Buffer", None), n, None))]
    if missing:
        return decline(
            f"deep_ep {_deep_ep_version()} has no Buffer.{', Buffer.'.join(missing)}: moehal calls DeepEP's "
            "legacy Buffer API (docs/backends/cuda.md)",
            "libraries",
        )
    return accept(f"deep_ep {_deep_ep_version()}", "libraries")


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether `fn` accepts the keyword `name`. A signature Python cannot read (a compiled
    function) counts as yes: the call itself will tell."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _round_scale_decision() -> Decision:
    """Power-of-two scales (the GROUP_128_UE8M0 format) need `round_scale`, which older DeepEP
    releases' `low_latency_dispatch` does not take."""
    import deep_ep

    if takes_keyword(deep_ep.Buffer.low_latency_dispatch, "round_scale"):
        return accept(predicate="format")
    return decline(
        f"deep_ep {_deep_ep_version()}'s low_latency_dispatch takes no round_scale ({ROUND_SCALE_SINCE}), so it "
        "cannot send the power-of-two scales these experts want; upgrade DeepEP, or use experts that take "
        "float scales",
        "format",
    )


def _parallel(req: BuildRequest, normal: bool) -> Decision:
    c = req.config
    if c.ep_size < 2:
        return decline("DeepEP moves tokens between ranks: needs ep_size >= 2", "parallel")
    if req.process_group is None:
        return decline("DeepEP needs MoELayer(process_group=...) (the expert-parallel group)", "parallel")
    if normal and c.ep_size not in DEFAULT_CONFIG_RANKS:
        return decline(f"DeepEP has default configs for {DEFAULT_CONFIG_RANKS} ranks, not {c.ep_size}", "parallel")
    if not normal and c.ep_size >= NVL_PEERS and c.ep_size % NVL_PEERS:
        return decline(f"DeepEP buffers take fewer than {NVL_PEERS} ranks or a multiple of {NVL_PEERS}", "parallel")
    return accept(predicate="parallel")


@dataclass
class SharedBuffer:
    """The process's `deep_ep.Buffer` for one (process group, mode), and what it was sized for.
    Runners read `.buffer` at each call: a later layer that needs more replaces it for all."""

    group: Any
    low_latency: bool
    num_nvl_bytes: int = 0
    num_rdma_bytes: int = 0
    num_qps_per_rank: int = 1
    buffer: Any = None

    @property
    def live(self) -> Any:
        """The buffer, or a clear error where a larger one failed to build after this one was
        freed (DeepEP must free the old one first); building a layer again makes a new one."""
        if self.buffer is None:
            raise RuntimeError(
                "this process's DeepEP buffer was freed to make a larger one for a later layer, and that "
                "build failed; build a layer on this process group again (every rank) to make a new one"
            )
        return self.buffer


_BUFFERS: dict[tuple[int, bool], SharedBuffer] = {}


def _shared_entry(group: Any, low_latency: bool) -> SharedBuffer | None:
    entry = _BUFFERS.get((id(group), low_latency))
    return entry if entry is not None and entry.group is group else None


def shared_buffer(group: Any, low_latency: bool, nvl_bytes: int, rdma_bytes: int, qps: int = 1) -> SharedBuffer:
    """The one buffer of `group` in this mode, at least this large. Built at layer build; a
    layer that needs more than the buffer holds replaces it with one sized for every layer so
    far (a collective: every rank builds the same layers in the same order). Low latency takes
    one QP per local expert (DeepEP: "requires that this number equals to the number of local
    experts"), so layers with another count cannot share it (`check_limits` declines them)."""
    import deep_ep

    key = (id(group), low_latency)
    entry = _shared_entry(group, low_latency)
    made_here = entry is None
    if entry is None:
        entry = _BUFFERS[key] = SharedBuffer(group, low_latency, num_qps_per_rank=qps)
    if low_latency and entry.buffer is not None and entry.num_qps_per_rank != qps:
        raise ValueError(
            f"this process's DeepEP low-latency buffer has {entry.num_qps_per_rank} QPs per rank, not {qps}"
        )
    if entry.buffer is None or nvl_bytes > entry.num_nvl_bytes or rdma_bytes > entry.num_rdma_bytes:
        # The sizes and the QP count are recorded once the buffer exists: a build that raises (out
        # of memory) must leave what a retry with smaller sizes, or another QP count, reads right.
        nvl, rdma = max(entry.num_nvl_bytes, nvl_bytes), max(entry.num_rdma_bytes, rdma_bytes)
        if entry.buffer is not None:
            # DeepEP frees a buffer, and its NVSHMEM state, when the object is collected; the old
            # one must be gone before the next is made
            entry.buffer = None
            collect()
        kw: dict[str, Any] = {"low_latency_mode": True, "num_qps_per_rank": qps} if low_latency else {}
        try:
            buffer = deep_ep.Buffer(group, nvl, rdma, **kw)
        except BaseException:
            if made_here:  # an entry no layer holds: forget it
                _BUFFERS.pop(key, None)
            raise
        entry.buffer, entry.num_nvl_bytes, entry.num_rdma_bytes = buffer, nvl, rdma
        if low_latency:
            entry.num_qps_per_rank = qps
    return entry


def release_buffers() -> int:
    """Drop every shared DeepEP buffer of this process (for tests and teardown); the number
    dropped. Runners built before must not be called afterwards."""
    n = len(_BUFFERS)
    for entry in _BUFFERS.values():
        entry.buffer = None
    _BUFFERS.clear()
    collect()
    return n


def collect() -> None:
    """`gc.collect()`, unless a CUDA graph capture runs in another thread (`moehal.graphs.gc_pauses`):
    it ignores `gc.disable()`, and a collection may free a dead graph, which a capture forbids. A
    buffer in no reference cycle is freed when dropped anyway."""
    from moehal.graphs import gc_pauses

    if gc_pauses() == 0:
        gc.collect()


@dataclass(frozen=True)
class _LLHandle:
    topk_ids: torch.Tensor
    weights: torch.Tensor
    handle: Any


class DeepEPLowLatencyRunner(DispatchRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        import deep_ep

        c = req.config
        self.fmt, self.c = fmt, c
        assert c.max_tokens is not None
        self.t_max = c.max_tokens
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(self.t_max, c.hidden_size, c.ep_size, c.num_experts)
        self.shared = shared_buffer(req.process_group, True, 0, rdma, max(1, c.num_local_experts))
        self.use_fp8 = fmt.is_quantized
        self.scale_kw = {"round_scale": True} if fmt.scales is ScaleKind.GROUP_128_UE8M0 else {}
        self.idx_dtype = _topk_idx_dtype()

    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[Any, _LLHandle]:
        c = self.c
        # DeepEP asserts contiguous x and top-k (dispatch and combine), and moves x in 16-byte
        # vectors; the caller's may be views (no copy otherwise)
        hidden, ids = dense_aligned(hidden), topk.ids.to(self.idx_dtype).contiguous()
        w = topk.weights.float().contiguous()
        if c.apply_router_weight_on_input:
            hidden = (hidden.float() * w).to(hidden.dtype)
            w = torch.ones_like(w)
        # round_scale only where wanted (float power-of-two scales: the GROUP_128_UE8M0 format),
        # so that releases from before it serve the other formats; use_ue8m0 (int32-packed
        # scales) is never asked for and keeps its default, False
        recv, count, handle, _, _ = self.shared.live.low_latency_dispatch(
            hidden, ids, self.t_max, c.num_experts, use_fp8=self.use_fp8, **self.scale_kw
        )
        x, s = recv if isinstance(recv, tuple) else (recv, None)
        expected = max(1, (self.t_max * c.ep_size * c.top_k + c.num_experts - 1) // c.num_experts)
        # each source token sends one row per top-k expert held here: a bound on sum(count) far
        # below the buffer's E_local * ep_size * T_max rows, which sizes the experts' grids
        bound = self.t_max * c.ep_size * min(c.top_k, c.num_local_experts)
        return MaskedInput(x, s, count, expected, bound), _LLHandle(ids, w, handle)

    def combine(self, expert_out: Any, handle: _LLHandle) -> torch.Tensor:
        assert isinstance(expert_out, MaskedOutput)
        out, _, _ = self.shared.live.low_latency_combine(
            expert_out.hidden.to(torch.bfloat16), handle.topk_ids, handle.weights, handle.handle
        )
        if self.c.routed_scaling_factor != 1.0:
            out = out * self.c.routed_scaling_factor
        return out.to(self.c.dtype)


class DeepEPLowLatencyDispatcher(Dispatcher):
    name = "deepep_ll"
    priority = 20
    description = "DeepEP low-latency all-to-all (masked layout, BF16 or FP8 1x128)"
    devices = frozenset({"cuda"})
    graph_capturable = True
    # DeepEP skips -1 ids in dispatch and combine (its own tests mask random slots so); not run here
    drops_padding_ids = True
    # its receive buffer is allocated once with torch::empty and rows past an expert's count keep
    # whatever they held: experts ignore padding rows (conformance fills them with NaN)
    zero_padding = False

    def check_hardware(self, req: BuildRequest) -> Decision:
        return sm_decision(req, (90, 100, 103), "DeepEP")

    def check_libraries(self, req: BuildRequest) -> Decision:
        return _deep_ep_decision(LL_CALLS)

    def check_parallel(self, req: BuildRequest) -> Decision:
        d = _parallel(req, normal=False)
        if not d.ok:
            return d
        return self.check_limits(req)

    @staticmethod
    def check_limits(req: BuildRequest) -> Decision:
        c = req.config
        if c.max_tokens is None:
            return decline("DeepEP low latency sizes its buffers by MoEConfig.max_tokens; set it", "parallel")
        if c.hidden_size not in LL_HIDDEN:
            return decline(f"DeepEP low latency supports hidden sizes {LL_HIDDEN}, not {c.hidden_size}", "parallel")
        if c.top_k > LL_MAX_TOPK:
            return decline(f"DeepEP low latency supports top_k <= {LL_MAX_TOPK}, got {c.top_k}", "parallel")
        newer = c.hidden_size in LL_HIDDEN_SINCE_V2 or c.top_k > LL_MAX_TOPK_BEFORE_V2
        if newer and _deep_ep_v2_layout() is False:
            return decline(
                f"this deep_ep {_deep_ep_version()} predates DeepEP's v2 layout (no deep_ep.buffers.legacy), "
                f"whose low-latency kernels take hidden sizes {LL_HIDDEN_SINCE_V2} and top_k up to {LL_MAX_TOPK} "
                f"(v1.2.1: neither, top_k <= {LL_MAX_TOPK_BEFORE_V2}; it asserts at the first dispatch); "
                f"got hidden {c.hidden_size}, top_k {c.top_k}",
                "parallel",
            )
        if c.max_tokens > LL_MAX_TOKENS:
            return decline(
                f"DeepEP low latency supports max_tokens <= {LL_MAX_TOKENS} per rank (its arrival counters), "
                f"got {c.max_tokens}",
                "parallel",
            )
        shared = _shared_entry(req.process_group, True)
        qps = max(1, c.num_local_experts)
        if shared is not None and shared.buffer is not None and shared.num_qps_per_rank != qps:
            return decline(
                f"this process's DeepEP low-latency buffer serves layers with {shared.num_qps_per_rank} local "
                f"experts; DeepEP keeps one per process, with one QP per local expert, and this layer has {qps}",
                "parallel",
            )
        if (c.ep_size * c.max_tokens) % 4:
            return decline("DeepEP low latency needs ep_size * max_tokens to be a multiple of 4", "parallel")
        raw = os.environ.get("NVSHMEM_QP_DEPTH", "1024")  # NVSHMEM's own variable, read as NVSHMEM reads it
        try:
            depth = int(raw)
        except ValueError:
            return decline(f"NVSHMEM_QP_DEPTH={raw!r} is not an integer (NVSHMEM's queue-pair depth)", "parallel")
        if depth < 2 * (c.max_tokens + 1):
            return decline(
                f"max_tokens={c.max_tokens} needs NVSHMEM_QP_DEPTH >= {2 * (c.max_tokens + 1)} (now {depth})",
                "parallel",
            )
        return accept(predicate="parallel")

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        if fmt.layout is not Layout.MASKED:
            return decline("DeepEP low latency produces the masked layout only", "format")
        if req.config.dtype != torch.bfloat16:
            return decline(_BF16_ONLY.format(dtype=req.config.dtype), "format")
        rows = req.config.ep_size * (req.config.max_tokens or 0)
        if rows % fmt.row_alignment:
            return decline(
                f"DeepEP low latency receives ep_size*max_tokens = {rows} rows per expert, not a multiple of "
                f"{fmt.row_alignment} as the experts need; choose max_tokens accordingly",
                "format",
            )
        if fmt.scales is ScaleKind.NONE:
            if fmt.dtype != torch.bfloat16:
                return decline(f"DeepEP low latency sends bf16, not {fmt.dtype}", "format")
            return accept(predicate="format")
        if fmt.scales in (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0) and fmt.dtype == torch.float8_e4m3fn:
            if req.config.hidden_size % 512:
                return decline("DeepEP FP8 low-latency dispatch needs hidden_size % 512 == 0", "format")
            if rows % LL_FP8_ROW_ALIGNMENT:
                return decline(
                    f"DeepEP FP8 low-latency dispatch needs ep_size*max_tokens ({rows}) to be a multiple of "
                    f"{LL_FP8_ROW_ALIGNMENT}: sgl-deep-ep strides its scales per expert by rows rounded up to it",
                    "format",
                )
            return _round_scale_decision() if fmt.scales is ScaleKind.GROUP_128_UE8M0 else accept(predicate="format")
        return decline(f"DeepEP low latency cannot produce {fmt}", "format")

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return DeepEPLowLatencyRunner(req, fmt)


@dataclass(frozen=True)
class _NormalHandle:
    handle: Any
    slot_row: torch.Tensor
    weights: torch.Tensor
    num_recv: int


class DeepEPNormalRunner(DispatchRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        import deep_ep
        from moehal.permute import contiguous_rows

        c = req.config
        self.fmt, self.c = fmt, c
        cfg = deep_ep.Buffer.get_dispatch_config(c.ep_size)
        nvl = cfg.get_nvl_buffer_size_hint(c.hidden_size * 2, c.ep_size)
        rdma = cfg.get_rdma_buffer_size_hint(c.hidden_size * 2, c.ep_size) if c.ep_size > NVL_PEERS else 0
        self.shared = shared_buffer(req.process_group, False, nvl, rdma)
        self.quant = fmt.is_quantized
        self.ue8m0 = fmt.scales is ScaleKind.GROUP_128_UE8M0
        self.idx_dtype = _topk_idx_dtype()
        # contiguous rows at the worst case; 0 (no max_tokens): `contiguous_workspace` rounds each
        # call's rows to a power of two, since a rank receives another count at every call
        self.capacity = 0
        if c.max_tokens is not None:
            slots = c.max_tokens * c.ep_size * min(c.top_k, c.num_local_experts)
            self.capacity = contiguous_rows(slots, c.num_local_experts, fmt.row_alignment)

    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[Any, _NormalHandle]:
        from moehal.kernels import triton_permute as tp

        c = self.c
        # DeepEP asserts contiguous x, topk_idx and topk_weights, and moves x in 16-byte vectors;
        # the caller's may be views
        hidden, ids = dense_aligned(hidden), topk.ids.to(self.idx_dtype).contiguous()
        w = topk.weights.float().contiguous()
        if c.apply_router_weight_on_input:
            hidden = (hidden.float() * w).to(hidden.dtype)
            w = torch.ones_like(w)
        buffer = self.shared.live
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, c.num_experts)
        recv_x, recv_ids, recv_w, _counts, handle, _ = buffer.dispatch(
            hidden,
            topk_idx=ids,
            topk_weights=w,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        n = recv_x.shape[0]  # received tokens; ids already local (-1: another rank's expert)
        rows = tp.contiguous_rows(n * c.top_k, c.num_local_experts, self.fmt.row_alignment)  # none if n == 0
        # n changes at every call: this call's rows of one buffer sized for the worst case
        # (every rank's max_tokens), not a persistent buffer per received count
        dest = tp.contiguous_workspace(
            "deepep.contiguous", rows, self.capacity, c.hidden_size, self.fmt.dtype, recv_x.device, self.quant
        )
        p = tp.permute(
            recv_x,
            recv_ids,
            recv_w,
            dest,
            expert_start=0,
            num_local_experts=c.num_local_experts,
            masked=False,
            alignment=self.fmt.row_alignment,
            ue8m0=self.ue8m0,
        )
        assert p.row_expert is not None and p.segment_start is not None
        inp = ContiguousInput(p.hidden, p.scales, p.row_expert, p.counts, p.segment_start)
        return inp, _NormalHandle(handle, p.slot_row, recv_w, n)

    def combine(self, expert_out: Any, handle: _NormalHandle) -> torch.Tensor:
        from moehal.kernels import triton_permute as tp

        assert isinstance(expert_out, ContiguousOutput)
        c = self.c
        partial = tp.combine(expert_out.hidden, handle.slot_row, handle.weights, handle.num_recv, c.top_k, masked=False)
        out, _, _ = self.shared.live.combine(partial, handle.handle)  # unweighted sum over source ranks
        if c.routed_scaling_factor != 1.0:
            out = out.float() * c.routed_scaling_factor
        return out.to(c.dtype)


class DeepEPNormalDispatcher(Dispatcher):
    name = "deepep"
    priority = 15
    description = "DeepEP normal all-to-all + Triton permute into the contiguous layout"
    devices = frozenset({"cuda"})
    graph_capturable = False  # DeepEP normal dispatch reports receive counts to the host
    # DeepEP sends no row for a -1 id and returns it as -1, which the permute drops; not run here
    drops_padding_ids = True

    def check_hardware(self, req: BuildRequest) -> Decision:
        return sm_decision(req, (90, 100, 103), "DeepEP")

    def check_libraries(self, req: BuildRequest) -> Decision:
        return _deep_ep_decision(NORMAL_CALLS)

    def check_parallel(self, req: BuildRequest) -> Decision:
        d = _parallel(req, normal=True)
        if d.ok and req.config.top_k > 128:
            return decline("DeepEP normal buffers are sized for top_k <= 128", "parallel")
        return d

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        if fmt.layout is not Layout.CONTIGUOUS:
            return decline("DeepEP normal mode is paired with the contiguous layout", "format")
        if req.config.dtype != torch.bfloat16:
            return decline(_BF16_ONLY.format(dtype=req.config.dtype), "format")
        if fmt.scales is ScaleKind.NONE:
            ok = fmt.dtype == req.config.dtype
            return accept(predicate="format") if ok else decline(f"sends {req.config.dtype}", "format")
        if fmt.scales in (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0) and fmt.dtype == torch.float8_e4m3fn:
            return accept("quantized to FP8 1x128 after the all-to-all, on the receiving rank", "format")
        return decline(f"cannot produce {fmt}", "format")

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return DeepEPNormalRunner(req, fmt)
