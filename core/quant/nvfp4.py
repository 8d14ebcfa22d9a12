"""NVFP4 reference quantization.

Values are e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), two per byte with the even
element in the low nibble. Every 16 consecutive elements of the last dim share an e4m3
block scale. A float32 *global scale* multiplies into the block scales, following
FlashInfer's `fp4_quantize`: global_scale = 448 * 6 / amax(tensor) (ModelOpt checkpoints
store its inverse as `weight_scale_2` / `input_scale`).

    x ~= e2m1(q) * float(block_scale) / global_scale
"""

from __future__ import annotations

import torch
from moehal.quant.ieee import div

E2M1_MAX = 6.0
E4M3_MAX = 448.0
SF_VEC = 16
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbours, with the round-to-nearest-even choice at exact ties:
# a tie goes up where the upper neighbour has an even mantissa (1.0, 2.0, 4.0 ... ).
_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def global_scale_for(x: torch.Tensor) -> torch.Tensor:
    """The conventional global scale: maps the tensor's amax onto 448 * 6."""
    return (E4M3_MAX * E2M1_MAX / x.float().abs().amax().clamp_min(1e-12)).float()


def _round_e2m1_index(mag: torch.Tensor) -> torch.Tensor:
    mids = torch.tensor(_MIDS, dtype=torch.float32, device=mag.device)
    tie_up = torch.tensor(_TIE_UP, device=mag.device)
    # bucketize(right=False): x == mid goes to the lower bucket; nudge tie-up mids down.
    adjusted = torch.where(tie_up, torch.nextafter(mids, torch.zeros_like(mids)), mids)
    return torch.bucketize(mag, adjusted, right=False)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit codes in uint8 (sign bit 3, magnitude index bits 0-2), saturating."""
    mag = x.float().abs().clamp(max=E2M1_MAX)
    idx = _round_e2m1_index(mag).to(torch.uint8)
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(_VALUES, dtype=torch.float32, device=codes.device)
    mag = values[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """`[..., K]` 4-bit codes -> uint8 `[..., K/2]`, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize(x: torch.Tensor, global_scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., K]` (K % 16 == 0) -> packed uint8 `[..., K/2]`, e4m3 block scales `[..., K/16]`.

    `global_scale` is a scalar or broadcasts against `x.shape[:-1]` (e.g. `[E, 1]` for
    per-expert weights `[E, N, K]`).
    """
    k = x.shape[-1]
    if k % SF_VEC:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {SF_VEC}, got {k}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    while gs.dim() and gs.dim() < x.dim() - 1:
        gs = gs.unsqueeze(-1)
    gs_blk = gs.unsqueeze(-1) if gs.dim() else gs  # broadcasts against [..., K/16]
    blocks = x.float().reshape(*x.shape[:-1], k // SF_VEC, SF_VEC)
    sf = (div(blocks.abs().amax(dim=-1), E2M1_MAX) * gs_blk).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf_f = sf.float()
    inv = torch.where(sf_f > 0, gs_blk / sf_f.clamp_min(1e-30), torch.zeros_like(sf_f))
    codes = encode_e2m1(blocks * inv.unsqueeze(-1)).reshape(x.shape)
    return pack(codes), sf


def block_values(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """The e2m1 values times their e4m3 block scales, in float32: `dequantize` before its
    division by the global scale. Each is exact in bf16 (at most 2 x 4 significant bits), so a
    bf16 GEMM on these operands, its output scaled by 1 / (global scales) in fp32 before its one
    rounding, computes what the dequantized operands would (`moehal_cuda.nvfp4_dequant`)."""
    vals = decode_e2m1(unpack(packed))
    sf = block_scale.float().repeat_interleave(SF_VEC, dim=-1)[..., : vals.shape[-1]]
    return vals * sf


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """Inverse of `quantize`, in float32."""
    vals = block_values(packed, block_scale)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    while gs.dim() and gs.dim() < vals.dim():
        gs = gs.unsqueeze(-1)
    return vals / gs


def qdq(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    return dequantize(*quantize(x, global_scale), global_scale)
