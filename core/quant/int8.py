"""INT8 W8A8 reference quantization: symmetric, per output channel for weights, dynamic
per token for activations (the scheme of SGLang's W8A8Int8 and Ascend's W8A8 dynamic).

Codes are `round(x / scale)` with ties to even, as vLLM's CUDA quantizer rounds. The Triton
`per_token_quant_int8` that SGLang's and vLLM's fused MoE call computes `x * (127 / amax)` and
rounds ties away from zero: about 1 code in 800 differs from this one by one step, with equal
scales. Conformance tolerances hold either; the reference picks one and says so."""

from __future__ import annotations

import torch
from moehal.quant.ieee import div

INT8_MAX = 127.0
_TINY = 1e-12


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., N, K]` -> int8 `[..., N, K]`, fp32 scales `[..., N]` (one per output row)."""
    scale = div(w.float().abs().amax(dim=-1).clamp_min(_TINY), INT8_MAX)
    q = torch.round(w.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., K]` -> int8 `[..., K]`, fp32 scales `[...]` (one per row)."""
    scale = div(x.float().abs().amax(dim=-1).clamp_min(_TINY), INT8_MAX)
    q = torch.round(x.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of either function above: scale broadcast over the last dim."""
    return q.float() * scale.float()[..., None]


def qdq_per_token(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_per_token(x))
