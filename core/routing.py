"""Routing: router logits -> top-k expert ids and weights.

Two ways into a layer: the caller routes (passes `TopK`), or the caller passes raw router
logits and the layer routes, either with the reference functions below or inside a kernel
that declares it can (e.g. TensorRT-LLM MoE, Ascend FuseEP).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from moehal.errors import ConfigError


class RoutingMethod(str, enum.Enum):
    """How scores are computed from logits before top-k."""

    SOFTMAX = "softmax"  # softmax over experts, then top-k (Mixtral, Qwen-MoE)
    SIGMOID = "sigmoid"  # top-k of the logits, weights their sigmoids (Llama-4 top-1)
    DEEPSEEK_V3 = "deepseek_v3"  # sigmoid + correction bias, grouped top-k (DeepSeek-V3/R1, Kimi-K2)


# The strings `RoutingConfig(method)` takes for a `RoutingMethod` (for type checkers; the test of
# the config types keeps them equal to the enum's values)
_RoutingMethodName = Literal["softmax", "sigmoid", "deepseek_v3"]


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How this layer turns router logits into top-k.

    Args:
        method: score function and selection rule, a `RoutingMethod` or its value ("softmax",
            "sigmoid", "deepseek_v3").
        renormalize: divide the selected weights by their sum (DeepSeek's norm_topk_prob).
        n_group, topk_group: DeepSeek-V3 grouped selection: experts are split into n_group
            groups, the best topk_group groups (by the sum of their two best scores) are kept.
            With a correction bias (DeepSeek-V3/R1, Kimi-K2) that is every implementation's
            rule. Without one, DeepSeek-V3's reference gate (`inference/model.py`) and vLLM's
            and SGLang's `grouped_topk` rank by the group's best score (DeepSeek-V2's rule),
            and the two keep different groups for most tokens. So a layer (`check`) refuses
            grouped selection (topk_group < n_group) without a bias; a zero bias gives the
            sum rule exactly, where that is what a model means.
        has_correction_bias: DeepSeek-V3 e_score_correction_bias, loaded with the weights.

    `check` also refuses `sigmoid` with `renormalize` at top_k=1: renormalizing one weight
    makes it exactly 1.0, where Llama-4's router (SGLang, vLLM: renormalize off) weights the
    token by the sigmoid of its top logit.
    """

    method: RoutingMethod = RoutingMethod.SOFTMAX
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    has_correction_bias: bool = False

    if TYPE_CHECKING:
        # For type checkers only; at run time the dataclass makes __init__ from the fields. It
        # takes `method` as a string too ("softmax"), which __post_init__ converts, so that
        # `config.method` still reads as a `RoutingMethod`. tests/core/test_config_types.py
        # keeps it equal to the fields.
        def __init__(
            self,
            method: RoutingMethod | _RoutingMethodName = RoutingMethod.SOFTMAX,
            renormalize: bool = True,
            n_group: int = 1,
            topk_group: int = 1,
            has_correction_bias: bool = False,
        ) -> None: ...

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", RoutingMethod(self.method))
        except ValueError:
            names = ", ".join(m.value for m in RoutingMethod)
            raise ConfigError(f"RoutingConfig.method must be one of {names}; got {self.method!r}") from None

    def check(self, num_experts: int, top_k: int) -> None:
        if self.method is RoutingMethod.DEEPSEEK_V3:
            for name in ("n_group", "topk_group"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ConfigError(f"RoutingConfig.{name} must be a positive integer, got {v!r}")
            if num_experts % self.n_group:
                raise ConfigError(f"num_experts={num_experts} not divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            per_group = num_experts // self.n_group
            if top_k > self.topk_group * per_group:
                raise ConfigError(
                    f"top_k={top_k} exceeds the experts in the kept groups ({self.topk_group}x{per_group})"
                )
            if self.topk_group < self.n_group and not self.has_correction_bias:
                raise ConfigError(
                    f"deepseek_v3 routing with n_group={self.n_group}, topk_group={self.topk_group} and no "
                    "correction bias: moehal ranks groups by the sum of their two best scores (DeepSeek-V3's "
                    "rule, which assumes a bias), while DeepSeek's reference gate, vLLM and SGLang rank "
                    "bias-free groups by their best score (DeepSeek-V2's rule), so the kept groups would "
                    "differ from the engines'. Set has_correction_bias=True and load the model's "
                    "e_score_correction_bias (zeros to mean the sum rule), or keep every group "
                    "(topk_group=n_group)"
                )
        elif self.has_correction_bias:
            raise ConfigError("a correction bias is only defined for the deepseek_v3 routing method")
        elif self.method is RoutingMethod.SIGMOID and self.renormalize and top_k == 1:
            raise ConfigError(
                "sigmoid routing with renormalize=True at top_k=1 weights every token 1.0 (one weight "
                "divided by itself); Llama-4's router weights it by the sigmoid of its top logit: "
                "use RoutingConfig('sigmoid', renormalize=False)"
            )


@dataclass(frozen=True, slots=True)
class TopK:
    """Routing output.

    ids: int32 or int64 `[T, K]` global expert ids (each token's ids distinct).
    weights: `[T, K]` router weights: float32 from `route`; from a caller, any float dtype
    (engines pass float32 or the layer dtype) and any strides, as `MoELayer` passes them on.
    """

    ids: torch.Tensor
    weights: torch.Tensor


def topk_lowest_index_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the `k` largest along the last dim, equal values in ascending index
    order. The vendors' routing kernels break ties so (TensorRT-LLM/FlashInfer order by value,
    then by the lower index); `torch.topk` leaves them unspecified, and with bf16 logits exact
    ties are common: about 3% of tokens at 128-256 experts, top-8. A stable descending sort
    costs more than `topk`, on the reference routing path only."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def route(
    logits: torch.Tensor,
    top_k: int,
    config: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
) -> TopK:
    """Reference routing in float32 (the oracle for kernels that route internally).

    logits: `[T, E]` any float dtype. Returns int32 ids and float32 weights. Equal scores go to
    the lower expert index, and equal group scores to the lower group (`topk_lowest_index_first`).
    """
    scores_in = logits.float()
    if config.method is RoutingMethod.SOFTMAX:
        scores = torch.softmax(scores_in, dim=-1)
        weights, ids = topk_lowest_index_first(scores, top_k)
    elif config.method is RoutingMethod.SIGMOID:
        # Select on the logits, then score the chosen (Llama-4's router; sigmoid is monotone):
        # float32 sigmoid is exactly 1.0 above a logit of about 16.6, so selecting on scores
        # would tie distinct logits and hand the tie to the lower index
        logits_k, ids = topk_lowest_index_first(scores_in, top_k)
        weights = torch.sigmoid(logits_k)
    else:
        scores = torch.sigmoid(scores_in)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        t, e = choice.shape
        grouped = choice.view(t, config.n_group, e // config.n_group)
        best2 = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best2, dim=-1).values.sum(-1)
        keep = topk_lowest_index_first(group_scores, config.topk_group)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        masked = choice.masked_fill(~expert_mask, float("-inf"))
        ids = topk_lowest_index_first(masked, top_k)[1]
        weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return TopK(ids=ids.to(torch.int32), weights=weights.float())
