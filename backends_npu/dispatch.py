"""Dispatchers that produce the plugin's flat low-latency layout (`npu_ll_flat`).

- `LocalFlatDispatcher` (one device): npu_moe_init_routing_v2 sorts the (token, k) slots by
  expert and, for W8A8, quantizes them per token in the same op; the group list comes back
  as counts (expert_tokens_num_type=1: the kernel, aclnnMoeInitRoutingV3, refuses 0, the
  cumulative form, on Ascend 950; Atlas A2/A3 take either). Combine gathers each slot's row
  through the op's gather index, weights and sums over k (plain torch).
- `HcclDispatcher` (expert parallelism across processes): npu_moe_distribute_dispatch /
  npu_moe_distribute_combine over the HCCL group (quant_mode 2 = dynamic per-token int8),
  group list as counts (expert_token_nums_type=1). Needs ep_size > 1 and a process group.

The generic torch.distributed all-to-all dispatcher lives in the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from moehal.capability import Decision, accept, decline
from moehal.ep_dispatcher import check_process_group
from moehal.formats import ActivationFormat, ScaleKind
from moehal.interfaces import BuildRequest, Dispatcher, DispatchRunner
from moehal.routing import TopK
from moehal_npu.common import (
    BACKEND,
    NPU_LL_FLAT,
    FlatInput,
    FlatOutput,
    NpuImplementation,
    ascend_generation,
    vendor_ops,
)

# npu_moe_distribute_dispatch limits (torch_npu ptaoplist_002364, and the op's tiling checks in
# ops-transformer mc2/moe_distribute_dispatch/op_host/op_tiling/moe_distribute_dispatch_tiling.cpp):
# K <= 8; at most 512 experts; H <= 7168 and a multiple of 32. Per chip (checked on NPU hardware;
# the emulation models no chip): Atlas A3 takes H = 7168 only, BS <= 512 and EP sizes from a
# list; Atlas A2 takes BS <= 256, EP sizes that are multiples of 8 up to 256, and at most 24
# experts per rank without HCCL's layered communication. Device names of neither kind are held
# to A2's rules.
HCCL_MAX_TOPK = 8
HCCL_MAX_HIDDEN = 7168
HCCL_HIDDEN_ALIGN = 32
HCCL_MAX_BS = 512
HCCL_MAX_EXPERTS = 512
HCCL_A3_RANKS = (8, 16, 32, 64, 128, 144, 256, 288)
HCCL_A2_MAX_RANKS = 256
HCCL_A2_MAX_BS = 256
HCCL_A2_MAX_LOCAL_EXPERTS = 24


def can_produce_flat(fmt: ActivationFormat, req: BuildRequest) -> Decision:
    if fmt.layout_name != NPU_LL_FLAT:
        return decline(f"produces only the {NPU_LL_FLAT!r} layout, not {fmt.layout_name!r}", "format")
    if fmt.scales is ScaleKind.NONE and fmt.dtype == req.config.dtype:
        return accept(predicate="format")
    if fmt.scales is ScaleKind.PER_TOKEN and fmt.dtype == torch.int8:
        return accept(predicate="format")
    return decline(f"emits bf16 rows or int8 rows with per-token scales, not {fmt}", "format")


@dataclass(frozen=True)
class _LocalHandle:
    row_idx: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


class LocalFlatRunner(DispatchRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        c = req.config
        self.fmt, self.ops = fmt, vendor_ops(req)
        self.start, self.num_local, self.num_experts = c.local_expert_start, c.num_local_experts, c.num_experts
        self.quantize = fmt.scales is ScaleKind.PER_TOKEN
        self.scale, self.weight_on_input, self.dtype = c.routed_scaling_factor, c.apply_router_weight_on_input, c.dtype

    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[FlatInput, _LocalHandle]:
        weights = topk.weights
        if self.weight_on_input:  # top_k == 1 (checked by MoEConfig)
            hidden = (hidden.float() * weights.float()).to(hidden.dtype)
            weights = torch.ones_like(weights)
        ids = topk.ids.to(torch.int32)
        x, row_idx, counts, x_scale = self.ops.moe_init_routing_v2(
            hidden,
            ids,
            num_experts=self.num_experts,
            active_expert_range=(self.start, self.start + self.num_local),
            quantize=self.quantize,
            expert_tokens_num_type=1,
        )
        out = FlatInput(x, x_scale if self.quantize else None, counts, 1)
        return out, _LocalHandle(row_idx, ids, weights)

    def combine(self, expert_out: Any, handle: _LocalHandle) -> torch.Tensor:
        if not isinstance(expert_out, FlatOutput):
            raise TypeError(f"flat combine takes FlatOutput, not {type(expert_out).__name__}")
        t, k = handle.ids.shape
        local = handle.ids.to(torch.int64).reshape(-1) - self.start
        valid = (local >= 0) & (local < self.num_local)
        rows = expert_out.hidden[handle.row_idx.to(torch.int64).clamp(min=0)].float()
        zero = torch.zeros((), device=rows.device)
        rows = torch.where(valid[:, None], rows, zero)  # dropped slots: whatever the gather index says
        w = torch.where(valid, handle.weights.reshape(-1).float(), zero)
        out = (rows * w[:, None]).view(t, k, rows.shape[-1]).sum(1)
        if self.scale != 1.0:
            out = out * self.scale
        return out.to(self.dtype)


class LocalFlatDispatcher(NpuImplementation, Dispatcher):
    """Single-device routing into `npu_ll_flat` with npu_moe_init_routing_v2."""

    name = "local_flat"
    priority = 10
    description = "npu_moe_init_routing_v2 (sort by expert, fused dynamic int8) into the flat layout"
    graph_capturable = True

    def check_parallel(self, req: BuildRequest) -> Decision:
        if req.config.ep_size > 1 and req.process_group is not None:
            return decline("tokens must move between expert-parallel ranks; the HCCL dispatcher does that", "parallel")
        return accept(predicate="parallel")  # ep_size > 1 in one process: this rank's partial sum

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        return can_produce_flat(fmt, req)

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return LocalFlatRunner(req, fmt)


@dataclass(frozen=True)
class _HcclHandle:
    num_tokens: int
    ids: torch.Tensor
    weights: torch.Tensor
    expand_idx: torch.Tensor
    ep_recv_counts: torch.Tensor
    expand_scales: torch.Tensor  # dispatch's, handed back to combine (required on Atlas A2)


class HcclRunner(DispatchRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        c = req.config
        self.fmt, self.ops, self.group = fmt, vendor_ops(req), req.process_group
        self.world, self.rank, self.num_experts = c.ep_size, c.ep_rank, c.num_experts
        self.max_tokens, self.top_k = int(c.max_tokens or 0), c.top_k
        self.quantize = fmt.scales is ScaleKind.PER_TOKEN
        self.scale, self.dtype = c.routed_scaling_factor, c.dtype
        world = torch.distributed.get_world_size(self.group)
        if world != self.world:
            raise ValueError(f"the process group has {world} ranks, MoEConfig.ep_size is {self.world}")
        # Padding rows (every rank sends max_tokens rows, as global_bs=0 requires): distinct
        # experts per row, weight zero, spread over all experts.
        pad = torch.arange(self.max_tokens * self.top_k).view(self.max_tokens, self.top_k) % self.num_experts
        self._pad_ids = pad.to(torch.int32)

    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[FlatInput, _HcclHandle]:
        t, h = hidden.shape
        dev = hidden.device
        x = torch.zeros(self.max_tokens, h, dtype=hidden.dtype, device=dev)
        x[:t] = hidden
        ids = self._pad_ids.to(dev).clone()
        ids[:t] = topk.ids.to(torch.int32)
        w = torch.zeros(self.max_tokens, self.top_k, dtype=torch.float32, device=dev)
        w[:t] = topk.weights.float()
        expand_x, dyn_scale, expand_idx, counts, recv, _tp, expand_scales = self.ops.moe_distribute_dispatch(
            x, ids, w, self.group, self.world, self.rank, self.num_experts, self.quantize
        )
        out = FlatInput(expand_x, dyn_scale if self.quantize else None, counts, 1)
        return out, _HcclHandle(t, ids, w, expand_idx, recv, expand_scales)

    def combine(self, expert_out: Any, handle: _HcclHandle) -> torch.Tensor:
        if not isinstance(expert_out, FlatOutput):
            raise TypeError(f"HCCL combine takes FlatOutput, not {type(expert_out).__name__}")
        y = self.ops.moe_distribute_combine(
            expert_out.hidden,
            handle.ids,
            handle.expand_idx,
            handle.ep_recv_counts,
            handle.weights,
            self.group,
            self.world,
            self.rank,
            self.num_experts,
            handle.expand_scales,
        )[: handle.num_tokens]
        if self.scale != 1.0:
            y = y.float() * self.scale
        return y.to(self.dtype)


class HcclDispatcher(NpuImplementation, Dispatcher):
    """Expert-parallel dispatch/combine with torch_npu's MoE distribute ops over HCCL."""

    name = "hccl"
    priority = 20
    description = "npu_moe_distribute_dispatch/combine over HCCL (dynamic int8 or bf16)"
    supports_router_weight_on_input = False
    graph_capturable = True

    def check_parallel(self, req: BuildRequest) -> Decision:
        if req.config.ep_size <= 1:
            return decline(
                "needs expert parallelism (MoEConfig.ep_size > 1); one rank uses the local dispatcher", "parallel"
            )
        if req.process_group is None:
            return decline("needs the expert-parallel process group: pass MoELayer(process_group=...)", "parallel")
        if req.emulating(BACKEND):
            return check_process_group(req)  # the emulation too: a wrong ep_rank routes to the wrong experts
        c, gen = req.config, ascend_generation(req.hardware.name)
        if gen == "A3" and c.ep_size not in HCCL_A3_RANKS:
            return decline(
                f"npu_moe_distribute_dispatch on Atlas A3 takes EP sizes {HCCL_A3_RANKS}, not {c.ep_size}", "parallel"
            )
        if gen != "A3":
            if c.ep_size % 8 or c.ep_size > HCCL_A2_MAX_RANKS:
                return decline(
                    f"npu_moe_distribute_dispatch on Atlas A2 takes EP sizes that are multiples of 8 up to "
                    f"{HCCL_A2_MAX_RANKS}, not {c.ep_size} (device {req.hardware.name!r})",
                    "parallel",
                )
            if c.num_local_experts > HCCL_A2_MAX_LOCAL_EXPERTS:
                return decline(
                    f"npu_moe_distribute_dispatch on Atlas A2 takes at most {HCCL_A2_MAX_LOCAL_EXPERTS} experts per "
                    f"rank without HCCL's layered communication, not {c.num_local_experts}",
                    "parallel",
                )
        return check_process_group(req)

    def check_shape(self, req: BuildRequest) -> Decision:
        c = req.config
        if c.top_k > HCCL_MAX_TOPK:
            return decline(f"npu_moe_distribute_dispatch takes top_k <= {HCCL_MAX_TOPK}, got {c.top_k}", "shape")
        if c.hidden_size > HCCL_MAX_HIDDEN or c.hidden_size % HCCL_HIDDEN_ALIGN:
            return decline(
                f"npu_moe_distribute_dispatch takes hidden_size <= {HCCL_MAX_HIDDEN} and a multiple of "
                f"{HCCL_HIDDEN_ALIGN}, got {c.hidden_size}",
                "shape",
            )
        if c.num_experts > HCCL_MAX_EXPERTS:
            return decline(f"npu_moe_distribute_dispatch takes at most {HCCL_MAX_EXPERTS} experts", "shape")
        if c.max_tokens is None or c.max_tokens > HCCL_MAX_BS:
            return decline(
                f"needs MoEConfig.max_tokens <= {HCCL_MAX_BS} (the per-rank batch bound of "
                "npu_moe_distribute_dispatch; 256 on Atlas A2)",
                "shape",
            )
        if req.emulating(BACKEND):
            return accept(predicate="shape")
        gen = ascend_generation(req.hardware.name)
        if gen == "A3" and c.hidden_size != HCCL_MAX_HIDDEN:
            return decline(f"npu_moe_distribute_dispatch on Atlas A3 takes hidden_size {HCCL_MAX_HIDDEN} only", "shape")
        if gen != "A3" and c.max_tokens > HCCL_A2_MAX_BS:
            return decline(
                f"npu_moe_distribute_dispatch on Atlas A2 takes max_tokens <= {HCCL_A2_MAX_BS} per rank, "
                f"not {c.max_tokens} (device {req.hardware.name!r})",
                "shape",
            )
        return accept(predicate="shape")

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        return can_produce_flat(fmt, req)

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return HcclRunner(req, fmt)
