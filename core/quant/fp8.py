"""FP8 (e4m3) reference quantization: 128x128 weight blocks, 1x128 activation groups,
per-tensor scales. Dequantization is `q.float() * scale` broadcast over the block."""

from __future__ import annotations

import math

import torch
from moehal.quant.ieee import div

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_TINY = 1e-12


def _scale_from_amax(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    scale = div(amax.float().clamp_min(_TINY), FP8_MAX)
    if ue8m0:
        # Round the scale *up* to a power of two so that q never overflows.
        scale = ceil_pow2(scale)
    return scale


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive normal float32 of `x`, from its bits (the
    exponent, plus one where the mantissa is not zero), as DeepEP's and SGLang's quantizers
    round UE8M0 scales. `exp2(ceil(log2(x)))` left the 2^k of up to ~16 ulp above 2^k, where
    float32's log2 rounds to exactly k. Inf and NaN stay as they are."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    up = ((bits & 0x7FFFFF) != 0) & (exp < 0xFF)
    return torch.where(exp == 0xFF, x.float(), ((exp + up.int()) << 23).view(torch.float32))


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    pad = (-size) % multiple
    if pad == 0:
        return x
    pads = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, pad]
    return torch.nn.functional.pad(x, pads)


def quantize_block(w: torch.Tensor, ue8m0: bool = False, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., N, K]` with one scale per `block x block` tile.

    Returns e4m3 `[..., N, K]` and fp32 scales `[..., ceil(N/block), ceil(K/block)]`.
    """
    n, k = w.shape[-2:]
    wp = _pad_to(_pad_to(w.float(), -1, block), -2, block)
    nb, kb = wp.shape[-2] // block, wp.shape[-1] // block
    tiles = wp.reshape(*wp.shape[:-2], nb, block, kb, block)
    scale = _scale_from_amax(tiles.abs().amax(dim=(-3, -1)), ue8m0)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(wp.shape)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of `quantize_block`, in float32."""
    n, k = q.shape[-2:]
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * s[..., :n, :k]


def quantize_group(x: torch.Tensor, ue8m0: bool = False, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., K]` with one scale per `group` consecutive elements of the last dim
    (the 1x128 per-token-group activation quantization of DeepSeek-V3).

    Returns e4m3 `[..., K]` and fp32 scales `[..., ceil(K/group)]`.
    """
    k = x.shape[-1]
    xp = _pad_to(x.float(), -1, group)
    g = xp.reshape(*xp.shape[:-1], xp.shape[-1] // group, group)
    scale = _scale_from_amax(g.abs().amax(dim=-1), ue8m0)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(xp.shape)[..., :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def dequantize_group(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]


def quantize_tensor(x: torch.Tensor, scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor quantization. With `scale` None the scale is amax/448 (dynamic)."""
    if scale is None:
        scale_t = _scale_from_amax(x.abs().amax(), False)
    else:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / scale_t).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_t


def qdq_group(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """Quantize then dequantize in 1x128 groups: what an FP8 block kernel sees."""
    return dequantize_group(*quantize_group(x, ue8m0))


def qdq_tensor(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    q, s = quantize_tensor(x, scale)
    return q.float() * s


def num_blocks(size: int, block: int = BLOCK) -> int:
    return math.ceil(size / block)
