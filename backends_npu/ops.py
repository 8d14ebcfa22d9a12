"""The thin typed facade over every vendor op the NPU backend calls.

`VendorOps(emulate=False)` calls torch_npu / DeepEP-Ascend (imported inside each call, never
at import of this module); `VendorOps(emulate=True)` calls the torch stand-ins in
`moehal_npu.emulation`, which follow the same documented semantics. The backend's runners
hold one `VendorOps` chosen at build, so the orchestration code is identical in both modes:
what is emulated is exactly this list of functions, nothing around them.
"""

from __future__ import annotations

from typing import Any

import torch

ACL_FORMAT_FRACTAL_NZ = 29
# npu_dequant_swiglu_quant with group_index: its output width must be <= 10496 and a multiple of
# 64, which the op checks (op-plugin docs, torch_npu-npu_dequant_swiglu_quant.md, constraints)
DEQUANT_SWIGLU_MAX = 10496
DEQUANT_SWIGLU_ALIGN = 64


def fuse_mode_enum() -> Any:
    """DeepEP-Ascend's `FuseMode` (`deep_ep.buffer`), or None where the installed release
    predates fuse modes: there `Buffer.fused_deep_moe` takes no `fuse_mode` and runs
    FUSED_DEEP_MOE (sgl-kernel-npu's earlier `deep_ep/buffer.py`)."""
    try:
        from deep_ep.buffer import FuseMode
    except ImportError:
        return None
    return FuseMode


class VendorOps:
    """One method per vendor op. Shapes and dtypes in each docstring; semantics (and the
    documentation each follows) in `moehal_npu.emulation`."""

    def __init__(self, emulate: bool) -> None:
        self.emulate = emulate

    @property
    def mode(self) -> str:
        return "emulated" if self.emulate else "native"

    # torch_npu ---------------------------------------------------------------------------------
    def grouped_matmul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        group_list: torch.Tensor,
        group_list_type: int,
        *,
        scale: torch.Tensor | None = None,
        per_token_scale: torch.Tensor | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """npu_grouped_matmul, split-M MoE form. x `[M, K]` (bf16, or int8), weight `[G, K, N]`
        (ND or NZ), group_list int64 `[G]` (type 0 cumsum ends, 1 counts), scale fp32 `[G, N]`,
        per_token_scale fp32 `[M]`, output_dtype bf16 or int32 (int8 x without scales).
        Returns `[M, N]`."""
        kw: dict[str, Any] = dict(
            group_list=group_list,
            split_item=2,
            group_type=0,
            group_list_type=group_list_type,
            output_dtype=output_dtype,
        )
        if scale is not None:
            kw["scale"] = [scale]
        if per_token_scale is not None:
            kw["per_token_scale"] = [per_token_scale]
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_grouped_matmul([x], [weight], **kw)[0]
        import torch_npu

        return torch_npu.npu_grouped_matmul([x], [weight], **kw)[0]

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """npu_swiglu(x, dim=-1): `[M, 2I]` -> `[M, I]` = silu(first half) * second half."""
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_swiglu(x, dim=-1)
        import torch_npu

        return torch_npu.npu_swiglu(x, dim=-1)

    def dequant_swiglu_quant(
        self,
        x: torch.Tensor,
        weight_scale: torch.Tensor,
        activation_scale: torch.Tensor,
        group_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """npu_dequant_swiglu_quant(activate_left=True, quant_mode=1): int32 `[M, 2I]` with
        weight_scale fp32 `[G, 2I]`, activation_scale fp32 `[M]`, group_index int64 counts `[G]`
        -> (int8 `[M, I]`, fp32 per-token scale `[M]`)."""
        kw: dict[str, Any] = dict(
            weight_scale=weight_scale,
            activation_scale=activation_scale,
            bias=None,
            quant_scale=None,
            quant_offset=None,
            group_index=group_index,
            activate_left=True,
            quant_mode=1,
        )
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_dequant_swiglu_quant(x, **kw)
        import torch_npu

        return torch_npu.npu_dequant_swiglu_quant(x, **kw)

    def format_cast_nz(self, t: torch.Tensor) -> torch.Tensor:
        """npu_format_cast(t, 29): to the FRACTAL_NZ physical layout (logical values unchanged)."""
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_format_cast(t, ACL_FORMAT_FRACTAL_NZ)
        import torch_npu

        return torch_npu.npu_format_cast(t, ACL_FORMAT_FRACTAL_NZ)

    def moe_init_routing_v2(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        *,
        num_experts: int,
        active_expert_range: tuple[int, int],
        quantize: bool,
        expert_tokens_num_type: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """npu_moe_init_routing_v2 (dropless, gather row index). x `[N, H]` bf16, expert_idx
        int32 `[N, K]` -> (expanded_x `[N*K, H]` bf16 or int8, expanded_row_idx int32 `[N*K]`,
        expert tokens int64 `[end-start]` (type 1: counts; 2: key-value pairs; the kernel,
        aclnnMoeInitRoutingV3, refuses 0 on Ascend 950), expanded_scale fp32 `[N*K]`)."""
        n, k = expert_idx.shape
        kw: dict[str, Any] = dict(
            scale=None,
            offset=None,
            active_num=n * k,
            expert_capacity=-1,
            expert_num=num_experts,
            drop_pad_mode=0,
            expert_tokens_num_type=expert_tokens_num_type,
            expert_tokens_num_flag=True,
            quant_mode=1 if quantize else -1,
            active_expert_range=list(active_expert_range),
            row_idx_type=0,
        )
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_moe_init_routing_v2(x, expert_idx, **kw)
        import torch_npu

        return torch_npu.npu_moe_init_routing_v2(x, expert_idx, **kw)

    # HCCL expert parallelism ---------------------------------------------------------------------
    @staticmethod
    def hccl_comm_name(group: Any) -> str:
        """The HCCL communicator name torch_npu's MoE distribute ops take for `group`."""
        rank = torch.distributed.get_rank(group)
        return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)

    def moe_distribute_dispatch(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        expert_scales: torch.Tensor,
        group: Any,
        world_size: int,
        rank: int,
        num_experts: int,
        quantize: bool,
    ) -> tuple[torch.Tensor, ...]:
        """npu_moe_distribute_dispatch: x `[BS, H]` bf16, expert_ids int32 `[BS, K]`,
        expert_scales fp32 `[BS, K]`; quant_mode 2 (dynamic int8) or 0; expert_token_nums_type 1
        (counts). Returns (expand_x `[A, H]`, dynamic_scales `[A]`, expand_idx, expert_token_nums
        int64 `[L]`, ep_recv_counts, tp_recv_counts, expand_scales)."""
        kw: dict[str, Any] = dict(
            expert_scales=expert_scales, quant_mode=2 if quantize else 0, global_bs=0, expert_token_nums_type=1
        )
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_moe_distribute_dispatch(x, expert_ids, group, world_size, rank, num_experts, **kw)
        import torch_npu

        name = self.hccl_comm_name(group)
        return torch_npu.npu_moe_distribute_dispatch(x, expert_ids, name, world_size, rank, num_experts, **kw)

    def moe_distribute_combine(
        self,
        expand_x: torch.Tensor,
        expert_ids: torch.Tensor,
        expand_idx: torch.Tensor,
        ep_send_counts: torch.Tensor,
        expert_scales: torch.Tensor,
        group: Any,
        world_size: int,
        rank: int,
        num_experts: int,
        expand_scales: torch.Tensor,
    ) -> torch.Tensor:
        """npu_moe_distribute_combine: expand_x `[A, H]` bf16 unweighted expert rows -> `[BS, H]`
        bf16, weighted by expert_scales and summed over k on the tokens' own rank.
        expand_scales: dispatch's last output, handed back (a required argument on Atlas A2;
        vllm-ascend always passes it)."""
        if self.emulate:
            from moehal_npu import emulation

            return emulation.npu_moe_distribute_combine(
                expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group, world_size, rank, num_experts,
                expand_scales=expand_scales,
            )  # fmt: skip
        import torch_npu

        name = self.hccl_comm_name(group)
        return torch_npu.npu_moe_distribute_combine(
            expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, name, world_size, rank, num_experts,
            expand_scales=expand_scales,
        )  # fmt: skip

    # DeepEP-Ascend -------------------------------------------------------------------------------
    def fused_deep_moe(
        self,
        buffer: Any,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        gmm1_permuted_weight: torch.Tensor,
        gmm1_permuted_weight_scale: torch.Tensor,
        gmm2_weight: torch.Tensor,
        gmm2_weight_scale: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        quant_mode: int,
        fuse_mode: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepEP-Ascend `Buffer.fused_deep_moe` on a low-latency buffer. x `[bs, H]` bf16,
        topk_idx int64 `[bs, K]`, topk_weights fp32 `[bs, K]`; weights per `moehal_npu.weights`.
        Returns (out `[bs, H]` bf16, a count of received rows: ep_recv_count `[local experts x
        ranks]` for FUSED_DEEP_MOE on A3, expert_token_nums `[local experts]` for
        DISPATCH_FFN_COMBINE; the runner discards it)."""
        args = (
            x,
            topk_idx,
            topk_weights,
            gmm1_permuted_weight,
            gmm1_permuted_weight_scale,
            gmm2_weight,
            gmm2_weight_scale,
            num_max_dispatch_tokens_per_rank,
            num_experts,
        )
        if self.emulate:
            from moehal_npu import emulation

            return emulation.fused_deep_moe(*args, quant_mode=quant_mode, fuse_mode=fuse_mode, buffer=buffer)
        modes = fuse_mode_enum()
        if modes is None:  # a release before fuse modes: its fused_deep_moe is FUSED_DEEP_MOE
            if fuse_mode != 1:
                raise RuntimeError("this DeepEP-Ascend predates fuse modes (no deep_ep.buffer.FuseMode)")
            return buffer.fused_deep_moe(*args, quant_mode=quant_mode)
        return buffer.fused_deep_moe(*args, quant_mode=quant_mode, fuse_mode=modes(fuse_mode))

    def low_latency_buffer(self, group: Any, max_tokens: int, hidden: int, num_experts: int, local: int) -> Any:
        """A DeepEP-Ascend `Buffer` in low-latency mode for fused_deep_moe (emulated: a record of
        what it was sized for, which the emulated fused_deep_moe checks its arguments against)."""
        if self.emulate:
            from moehal_npu import emulation

            return emulation.low_latency_buffer(group, max_tokens, hidden, num_experts, local)
        key = (id(group), max_tokens, hidden, num_experts, local)
        kept = _LL_BUFFERS.get(key)
        if kept is not None:
            return kept[1]
        from deep_ep import Buffer

        world = torch.distributed.get_world_size(group)
        size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
        buf = Buffer(group, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=local)
        _LL_BUFFERS[key] = (group, buf)  # (the group kept alive: its id names it)
        return buf


# One DeepEP-Ascend low-latency Buffer per (process group, sizes), shared by every FuseEP layer
# of that shape, as SGLang keeps one per process and moehal_cuda one per group and mode: a
# Buffer per layer multiplied the communication buffers by the layer count. Layers run one
# after another on a stream, so sharing is safe; every rank builds the same layers in the same
# order, so each creates (a collective) or reuses the same buffers.
_LL_BUFFERS: dict[tuple[int, int, int, int, int], tuple[Any, Any]] = {}


def release_low_latency_buffers() -> int:
    """Forget the shared low-latency Buffers (freed once no layer holds one); returns how many."""
    n = len(_LL_BUFFERS)
    _LL_BUFFERS.clear()
    return n
