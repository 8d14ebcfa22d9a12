"""`cuda.permute`: single-GPU dispatch into the masked, contiguous or standard layout with the
Triton kernels of `moehal.kernels.triton_permute` (no host sync, CUDA-graph capturable).

Destination buffers are process-wide persistent workspaces (one per shape), so a dispatch
output is valid until the next dispatch of the same shape: one micro-batch in flight per shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from moehal import permute as torch_permute
from moehal.capability import Decision, accept, decline
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
from moehal.kernels.host import next_power_of_2
from moehal.quant.activation import quantize_activation
from moehal.routing import TopK
from moehal_cuda.support import cuda_or_interpreter, interpreted_mode, triton_decision

_QUANT_KINDS = (ScaleKind.GROUP_128, ScaleKind.GROUP_128_UE8M0, ScaleKind.STATIC_TENSOR)
# Token counts up to this keep their bound permute launches (one per count): decode-sized
# batches, whose eager host time is mostly this argument preparation; larger batches bind at
# every call (their GPU time dwarfs it) so a stream of prefill sizes keeps nothing.
KEEP_BOUND_TOKENS = 256


@dataclass(frozen=True)
class PermuteHandle:
    slot_row: torch.Tensor | None  # int32 [T*K], -1 = not local (masked/contiguous)
    weights: torch.Tensor | None  # fp32 [T, K], None = unweighted (router weight on input)
    num_tokens: int
    combine: Any = None  # masked/contiguous: the combine's launch for this token count (`tp.BoundCombine`)


class PermuteRunner(DispatchRunner):
    tokens_in_place = True  # one device: token-major rows are the layer's tokens

    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        c = req.config
        self.fmt = fmt
        self.config = c
        self.e, self.k, self.start = c.num_local_experts, c.top_k, c.local_expert_start
        self.quant = fmt.is_quantized
        self.ue8m0 = fmt.scales is ScaleKind.GROUP_128_UE8M0
        self.static = fmt.scales is ScaleKind.STATIC_TENSOR
        self.static_scale: torch.Tensor | None = None  # STATIC_TENSOR: the weights' a13_scale
        self.dtype = c.dtype
        self.scale = float(c.routed_scaling_factor)
        self.on_input = c.apply_router_weight_on_input
        self.all_local = self.start == 0 and self.e == c.num_experts
        # token count -> its permute and combine launches (`tp.bind_permute`, `tp.bind_combine`)
        self._bound: dict[int, tuple[Any, Any]] = {}

    def load_input_scale(self, scale: torch.Tensor) -> None:
        self.static_scale = scale
        self._bound.clear()  # their scatter launches hold the previous scale tensor

    def _buffer(self, t: int, device: torch.device) -> Any:
        from moehal.kernels import triton_permute as tp

        c, dt = self.config, (self.fmt.dtype if self.quant else self.dtype)
        name = f"dispatch.{self.fmt.layout_name}"
        if self.fmt.layout is Layout.MASKED:
            # no max_tokens: buffers for token counts rounded up to a power of two, so a stream
            # of batch sizes keeps a few of them (within 2x of the largest), not one per size
            rows_for = c.max_tokens if c.max_tokens is not None else next_power_of_2(t)
            lead = (self.e, tp.masked_rows(rows_for, math.lcm(64, self.fmt.row_alignment)))
            return tp.workspace(name, lead, c.hidden_size, dt, device, self.quant)
        # contiguous: this call's rows of a buffer sized once for max_tokens (without it, a
        # capacity of 0 lets `contiguous_workspace` round each call's rows to a power of two)
        rows = tp.contiguous_rows(t * self.k, self.e, self.fmt.row_alignment)
        cap = tp.contiguous_rows(c.max_tokens * self.k, self.e, self.fmt.row_alignment) if c.max_tokens else 0
        return tp.contiguous_workspace(name, rows, cap, c.hidden_size, dt, device, self.quant)

    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[Any, PermuteHandle]:
        t = hidden.shape[0]
        weights = topk.weights.float() if topk.weights.dtype != torch.float32 else topk.weights
        layout = self.fmt.layout
        if self.static and self.static_scale is None:
            raise RuntimeError(
                f"{self.fmt} dispatch has no static input scale yet: load the layer's weights before its forward"
            )
        if layout is Layout.STANDARD:
            x = hidden
            if self.on_input:
                x = (hidden.float() * weights).to(hidden.dtype)
                weights = torch.ones_like(weights)
            q, s = quantize_activation(x, self.fmt.scales, self.static_scale)
            # every expert local (one GPU): global ids are the local ids, no kernel needed
            ids = topk.ids
            if not self.all_local:
                ids = torch_permute.local_topk_ids(ids, self.start, self.e)
            elif ids.dtype != torch.int32 or not ids.is_contiguous():
                ids = ids.to(torch.int32).contiguous()
            return StandardInput(q, s, ids, weights), PermuteHandle(None, None, t)
        masked = layout is Layout.MASKED
        bound = self._bound.get(t)
        if bound is None:  # the destination, tiles and launch arguments of this token count
            from moehal.kernels import triton_permute as tp  # (not per call: ~1 us of an eager step)

            h = hidden.shape[1]
            bound = (
                tp.bind_permute(
                    t, self.k, h, self._buffer(t, hidden.device), expert_start=self.start, num_local_experts=self.e,
                    masked=masked, alignment=self.fmt.row_alignment, ue8m0=self.ue8m0, weight_on_input=self.on_input,
                    static_scale=self.static_scale, keep=t <= KEEP_BOUND_TOKENS,
                ),
                tp.bind_combine(
                    t, self.k, h, masked=masked, weighted=not self.on_input, scaling=self.scale, out_dtype=self.dtype
                ),
            )  # fmt: skip
            if t <= KEEP_BOUND_TOKENS:
                self._bound[t] = bound
        p = bound[0](hidden, topk.ids, weights)
        handle = PermuteHandle(p.slot_row, None if self.on_input else weights, t, bound[1])
        if masked:
            expected_m = max(1, (t * self.k + self.e - 1) // self.e)
            return MaskedInput(p.hidden, p.scales, p.counts, expected_m, t * self.k), handle
        assert p.row_expert is not None and p.segment_start is not None
        return ContiguousInput(p.hidden, p.scales, p.row_expert, p.counts, p.segment_start), handle

    def combine(self, expert_out: Any, handle: PermuteHandle) -> torch.Tensor:
        return self._combine(expert_out, handle, None)

    def combine_into(self, expert_out: Any, handle: PermuteHandle, out: torch.Tensor) -> torch.Tensor:
        y = self._combine(expert_out, handle, out)  # the gather-and-sum kernel writes `out` itself
        return y if y is out else out.copy_(y)

    def _combine(self, expert_out: Any, handle: PermuteHandle, out: torch.Tensor | None) -> torch.Tensor:
        if isinstance(expert_out, StandardOutput):
            y = expert_out.hidden
            if self.scale == 1.0 or expert_out.scaled:  # (a no-op .to() costs an eager step ~1-2 us)
                return y if y.dtype == self.dtype else y.to(self.dtype)
            return (y.float() * self.scale).to(self.dtype)
        if isinstance(expert_out, (MaskedOutput, ContiguousOutput)):
            assert handle.slot_row is not None
            launch = handle.combine
            if launch is None or launch.masked != isinstance(expert_out, MaskedOutput):  # experts of another layout
                from moehal.kernels import triton_permute as tp

                return tp.combine(
                    expert_out.hidden, handle.slot_row, handle.weights, handle.num_tokens, self.k,
                    masked=isinstance(expert_out, MaskedOutput), scaling=self.scale, out_dtype=self.dtype, out=out,
                )  # fmt: skip
            return launch(expert_out.hidden, handle.slot_row, handle.weights, out)
        raise TypeError(f"cuda.permute cannot combine {type(expert_out).__name__}")


class CudaPermuteDispatcher(Dispatcher):
    """Single-device permute into masked / contiguous / standard layouts with Triton kernels."""

    name = "permute"
    priority = 10
    description = "single-GPU Triton permute (masked, contiguous, standard), fused FP8 quant (1x128 groups or static)"
    devices = frozenset({"cuda", "cpu"})
    graph_capturable = True
    # the permute kernels count a slot only for a local expert; token-major batches pass -1 on
    # as a local -1, which STANDARD experts skip (another rank's expert)
    drops_padding_ids = True

    def execution_mode(self, req: BuildRequest) -> str:
        return interpreted_mode(req)

    def check_hardware(self, req: BuildRequest) -> Decision:
        return cuda_or_interpreter(req)

    def check_libraries(self, req: BuildRequest) -> Decision:
        return triton_decision()

    def check_parallel(self, req: BuildRequest) -> Decision:
        # One device: with a process group, tokens must cross ranks (an EP dispatcher's job);
        # a local permute would silently compute a partial sum.
        if req.config.ep_size > 1 and req.process_group is not None:
            return decline(
                "moves tokens on one GPU only; expert parallelism across processes needs an EP "
                "dispatcher (DeepEP, or reference.torch_distributed)",
                "parallel",
            )
        return accept(predicate="parallel")

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        if not isinstance(fmt.layout, Layout):
            return decline(f"layout {fmt.layout_name!r} is not a core layout", "format")
        if fmt.scales is ScaleKind.NONE:
            if fmt.dtype != req.config.dtype:
                return decline(
                    f"unquantized dispatch keeps the layer dtype {req.config.dtype}, not {fmt.dtype}", "format"
                )
            return accept(predicate="format")
        if fmt.scales not in _QUANT_KINDS:
            return decline(
                f"quantizes to fp8 (1x128 groups, or a static input scale) only, not {fmt.scales.value}", "format"
            )
        if fmt.dtype != torch.float8_e4m3fn:
            return decline(f"fp8 dispatch writes float8_e4m3fn, not {fmt.dtype}", "format")
        return accept(predicate="format")

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return PermuteRunner(req, fmt)
