"""Reference expert activations, applied to the first GEMM's output `[..., N13]`."""

from __future__ import annotations

import torch
from moehal.config import Activation, MoEConfig


def apply_activation(h: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """`[..., 2I]` ([gate; up] halves) -> `[..., I]` when gated; `[..., I]` -> `[..., I]` when not."""
    act = config.activation
    if not config.gated:
        return torch.nn.functional.silu(h) if act is Activation.SILU else torch.nn.functional.gelu(h)
    gate, up = h.chunk(2, dim=-1)
    if act is Activation.SILU:
        return torch.nn.functional.silu(gate) * up
    if act is Activation.GELU:
        return torch.nn.functional.gelu(gate) * up
    # SwiGLU-OAI (gpt-oss): gate clamped from above, up clamped both ways, up shifted by one.
    limit, alpha = config.swiglu_limit, config.swiglu_alpha
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)
