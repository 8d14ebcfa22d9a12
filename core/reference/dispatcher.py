"""The reference dispatcher: single-device permute in torch, any device, no host sync."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from moehal import permute
from moehal.capability import Decision, accept, decline
from moehal.errors import ContractError
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    StandardInput,
    StandardOutput,
)
from moehal.interfaces import BuildRequest, Dispatcher, DispatchRunner
from moehal.quant.activation import check_core_format, quantize_activation
from moehal.routing import TopK


@dataclass(frozen=True)
class _Handle:
    idx: permute.SlotIndex | None
    weights: torch.Tensor
    slot_row: torch.Tensor | None = None


class LocalDispatchRunner(DispatchRunner):
    tokens_in_place = True  # one device: token-major rows are the layer's tokens

    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        self.fmt = fmt
        c = req.config
        self.expert_start, self.num_local = c.local_expert_start, c.num_local_experts
        self.top_k, self.max_tokens = c.top_k, c.max_tokens
        self.scale = c.routed_scaling_factor
        self.weight_on_input = c.apply_router_weight_on_input
        self.dtype = c.dtype

    def dispatch(self, hidden: torch.Tensor, topk: TopK) -> tuple[Any, _Handle]:
        weights = topk.weights
        if self.weight_on_input:  # top_k == 1 (checked by MoEConfig)
            hidden = (hidden.float() * weights.float()).to(hidden.dtype)
            weights = torch.ones_like(weights)
        layout = self.fmt.layout
        if layout is Layout.STANDARD:
            q, s = quantize_activation(hidden, self.fmt.scales)
            ids = permute.local_topk_ids(topk.ids, self.expert_start, self.num_local)
            return StandardInput(q, s, ids, weights.float()), _Handle(None, weights)
        idx = permute.index_slots(topk.ids, self.expert_start, self.num_local)
        if layout is Layout.MASKED:
            max_m = self.max_tokens if self.max_tokens is not None else hidden.shape[0]
            max_m = permute.round_up(max_m, self.fmt.row_alignment)
            x, masked_m = permute.to_masked(hidden, idx, max_m)
            q, s = quantize_activation(x, self.fmt.scales)
            expected_m = max(1, (hidden.shape[0] * self.top_k + self.num_local - 1) // self.num_local)
            return MaskedInput(q, s, masked_m, expected_m, hidden.shape[0] * self.top_k), _Handle(idx, weights)
        x, row_expert, seg_start, slot_row = permute.to_contiguous(hidden, idx, self.fmt.row_alignment)
        q, s = quantize_activation(x, self.fmt.scales)
        return ContiguousInput(q, s, row_expert, idx.counts, seg_start), _Handle(idx, weights, slot_row)

    def combine(self, expert_out: Any, handle: _Handle) -> torch.Tensor:
        scale = self.scale
        got = type(expert_out).__name__
        if isinstance(expert_out, StandardOutput):
            rows = handle.weights.shape[0]  # the tokens: a token-major output has one row each
            if expert_out.hidden.dim() != 2 or expert_out.hidden.shape[0] != rows:
                raise ContractError(
                    f"the experts returned a StandardOutput of shape {list(expert_out.hidden.shape)} for {rows} "
                    f"tokens (dispatched as {self.fmt.layout_name}): token-major output has one row per token"
                )
            out = expert_out.hidden.float()
            scale = 1.0 if expert_out.scaled else scale
        elif isinstance(expert_out, MaskedOutput) and handle.idx is not None and handle.slot_row is None:
            out = permute.from_masked(expert_out.hidden, handle.idx, handle.weights)
        elif isinstance(expert_out, ContiguousOutput) and handle.idx is not None and handle.slot_row is not None:
            out = permute.from_contiguous(expert_out.hidden, handle.idx, handle.slot_row, handle.weights)
        else:
            raise ContractError(
                f"the experts returned {got} for input dispatched as {self.fmt.layout_name}: its output type is "
                "StandardOutput, or the one of its input's layout (MaskedOutput, ContiguousOutput)"
            )
        if scale != 1.0:
            out = out * scale
        return out.to(self.dtype)


class ReferenceDispatcher(Dispatcher):
    """Permutes tokens on this device into any core layout, quantizing on the way if asked."""

    name = "local"
    priority = 0
    description = "single-device torch permute into standard, contiguous or masked layouts"
    graph_capturable = True
    drops_padding_ids = True  # ids outside this rank's experts, -1 included, map to no slot

    def can_produce(self, fmt: ActivationFormat, req: BuildRequest) -> Decision:
        return check_core_format(fmt, req.config.dtype)

    def check_parallel(self, req: BuildRequest) -> Decision:
        # With ep_size > 1 and no process group it computes this rank's partial sum in one
        # process (conformance's local-expert-range case). With a process group, tokens must
        # move between ranks: a partial sum would be silently wrong, so decline.
        if req.config.ep_size > 1 and req.process_group is not None:
            return decline(
                f"ep_size={req.config.ep_size} with a process group needs tokens moved between ranks; the local "
                "dispatcher would compute only this rank's partial sum (use an EP dispatcher such as "
                "reference.torch_distributed)",
                "parallel",
            )
        return accept(predicate="parallel")

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> DispatchRunner:
        return LocalDispatchRunner(req, fmt)
