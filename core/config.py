"""The layer configuration: what an MoE layer computes, independent of hardware."""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
from moehal.errors import ConfigError
from moehal.routing import RoutingConfig


class Activation(str, enum.Enum):
    """The expert activation. Gated variants use w13 = [gate; up] halves."""

    SILU = "silu"
    GELU = "gelu"
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamped gate*sigmoid(alpha*gate)*(up+1); always gated


# The strings `MoEConfig(activation=...)` takes for an `Activation` (for type checkers; the test
# of the config types keeps them equal to the enum's values)
_ActivationName = Literal["silu", "gelu", "swiglu_oai"]


_DTYPES = {torch.bfloat16, torch.float16, torch.float32}


def _as_int(owner: str, name: str, value: object) -> int:
    """`value` as a Python int (numpy and torch integers included); a float, a bool or
    anything else is a ConfigError, where `int()` would truncate 127.5 to 127."""
    if isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{owner}.{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Everything about the math of one MoE layer.

    Weight layout (canonical, what `load_weights` takes): w13 `[E_local, 2*I, H]` as
    `[gate; up]` halves when gated (`[E_local, I, H]` when not), w2 `[E_local, H, I]`.

    Args:
        num_experts: global expert count E.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: I (per expert, per partition).
        activation: expert activation, an `Activation` or its value ("silu", "gelu", "swiglu_oai").
        gated: whether w13 holds gate and up halves.
        swiglu_alpha, swiglu_limit: SwiGLU-OAI parameters (gpt-oss uses 1.702 and 7.0).
        has_w13_bias, has_w2_bias: whether biases are part of the weights.
        routed_scaling_factor: multiplies the combined output (DeepSeek-V3 uses 2.5).
        apply_router_weight_on_input: scale the input by the router weight instead of
            the output (Llama-4 style); requires top_k == 1.
        ep_rank, ep_size: expert parallelism; this rank owns a contiguous slice of experts.
        dtype: activation and unquantized parameter dtype.
        routing: how router logits become top-k ids; None if the caller always passes top-k.
        max_tokens: upper bound of tokens per forward, used to size static buffers
            (masked layouts, CUDA graphs). None means "the batch size of each call".
        topk_padding: `topk_ids` may hold -1, a slot that contributes nothing (engines mark
            padded tokens' slots so: SGLang, DeepEP). Selection then keeps only pipelines whose
            dispatcher or fused forward declares `drops_padding_ids`. False: ids must lie in
            [0, num_experts).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: Activation = Activation.SILU
    gated: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    has_w13_bias: bool = False
    has_w2_bias: bool = False
    routed_scaling_factor: float = 1.0
    apply_router_weight_on_input: bool = False
    ep_rank: int = 0
    ep_size: int = 1
    dtype: torch.dtype = torch.bfloat16
    routing: RoutingConfig | None = None
    max_tokens: int | None = None
    topk_padding: bool = False

    if TYPE_CHECKING:
        # For type checkers only; at run time the dataclass makes __init__ from the fields. It
        # takes `activation` as a string too ("silu"), which __post_init__ converts, so that
        # `cfg.activation` still reads as an `Activation`. tests/core/test_config_types.py keeps
        # it equal to the fields (names, order, defaults, annotations).
        def __init__(
            self,
            num_experts: int,
            top_k: int,
            hidden_size: int,
            intermediate_size: int,
            activation: Activation | _ActivationName = Activation.SILU,
            gated: bool = True,
            swiglu_alpha: float = 1.702,
            swiglu_limit: float = 7.0,
            has_w13_bias: bool = False,
            has_w2_bias: bool = False,
            routed_scaling_factor: float = 1.0,
            apply_router_weight_on_input: bool = False,
            ep_rank: int = 0,
            ep_size: int = 1,
            dtype: torch.dtype = torch.bfloat16,
            routing: RoutingConfig | None = None,
            max_tokens: int | None = None,
            topk_padding: bool = False,
        ) -> None: ...

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "activation", Activation(self.activation))
        except ValueError:
            names = ", ".join(a.value for a in Activation)
            raise ConfigError(f"MoEConfig.activation must be one of {names}; got {self.activation!r}") from None
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "ep_size", "ep_rank"):
            object.__setattr__(self, name, _as_int("MoEConfig", name, getattr(self, name)))
        if self.max_tokens is not None:
            object.__setattr__(self, "max_tokens", _as_int("MoEConfig", "max_tokens", self.max_tokens))
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "ep_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MoEConfig.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.ep_size:
            raise ConfigError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}; "
                "moehal shards experts evenly across ranks"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ConfigError(f"ep_rank={self.ep_rank} outside [0, ep_size={self.ep_size})")
        if self.activation is Activation.SWIGLU_OAI and not self.gated:
            raise ConfigError("activation swiglu_oai is gated by definition; set gated=True")
        # NaN or a non-positive clamp would make every output NaN or constant, silently
        if not math.isfinite(self.swiglu_alpha):
            raise ConfigError(f"MoEConfig.swiglu_alpha must be finite, got {self.swiglu_alpha}")
        if not self.swiglu_limit > 0:
            raise ConfigError(f"MoEConfig.swiglu_limit must be > 0 (inf: no clamp), got {self.swiglu_limit}")
        if not math.isfinite(self.routed_scaling_factor):
            raise ConfigError(f"MoEConfig.routed_scaling_factor must be finite, got {self.routed_scaling_factor}")
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ConfigError(
                "apply_router_weight_on_input needs top_k == 1 (the input is shared by all "
                f"k slots, so a per-slot scale is ill-defined); got top_k={self.top_k}"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of bf16, fp16, fp32; got {self.dtype}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ConfigError("max_tokens must be positive or None")
        if self.routing is not None:
            if not isinstance(self.routing, RoutingConfig):
                raise ConfigError(
                    f"MoEConfig.routing must be a RoutingConfig or None, got {self.routing!r} "
                    f"(e.g. routing=moehal.RoutingConfig({self.routing!r}))"
                )
            self.routing.check(self.num_experts, self.top_k)

    # Derived quantities -------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_expert_start(self) -> int:
        return self.ep_rank * self.num_local_experts

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank owns."""
        return range(self.local_expert_start, self.local_expert_start + self.num_local_experts)

    @property
    def w13_rows(self) -> int:
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    def with_(self, **changes: object) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        act = self.activation.value + ("" if self.gated else " (non-gated)")
        ep = f", EP {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        pad = ", -1 ids" if self.topk_padding else ""
        return (
            f"E={self.num_experts} top{self.top_k} H={self.hidden_size} I={self.intermediate_size} "
            f"{act} {str(self.dtype).removeprefix('torch.')}{ep}{pad}"
        )
