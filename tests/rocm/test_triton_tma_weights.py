"""The fused MoE's TMA weight loads (`TileConfig.tma`, Hopper) compute what its pointer loads
compute: same tiles, same accumulation order, so the outputs are equal. In CI the interpreter
emulates the descriptors (their zero fill past the tensor's end included); on an SM90 GPU the
loads are TMA's. Also: where TMA cannot read the weights, a TMA tile falls back to pointer loads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _rocm_testing import DEVICE, needs_triton

pytestmark = needs_triton


def _weights(quant: str, e: int, h: int, i: int, gen: torch.Generator):
    from moehal.kernels import triton_fused_moe as k

    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5
    if quant == "bf16":
        return k.TritonMoEWeights(w13.bfloat16().to(DEVICE), w2.bfloat16().to(DEVICE))
    if quant == "fp8_block":
        s13 = (torch.rand(e, 2 * i // 128 + 1, h // 128 + 1, generator=gen) + 0.5) * 0.01
        s2 = (torch.rand(e, h // 128 + 1, i // 128 + 1, generator=gen) + 0.5) * 0.01
        f8 = torch.float8_e4m3fn
        return k.TritonMoEWeights(
            (w13 * 100).to(f8).to(DEVICE), (w2 * 100).to(f8).to(DEVICE), "fp8_block", s13.to(DEVICE), s2.to(DEVICE)
        )
    s13, s2 = torch.rand(e, 2 * i, generator=gen) * 0.01, torch.rand(e, h, generator=gen) * 0.01
    q13, q2 = (w13 * 400).clamp(-127, 127).to(torch.int8), (w2 * 400).clamp(-127, 127).to(torch.int8)
    return k.TritonMoEWeights(q13.to(DEVICE), q2.to(DEVICE), "int8", s13.to(DEVICE), s2.to(DEVICE))


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "int8"])
@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu", False)])
def test_tma_weight_tiles_equal_pointer_loads(quant, activation, gated):
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tiles import TileConfig

    # I = 48 is not a multiple of the 32-wide N tile: the last gate tile reads up rows (never stored).
    e, h, i, t, top_k = 4, 128, 48, 9, 2
    gen = torch.Generator().manual_seed(1)
    w = _weights(quant, e, h, i, gen)
    if not gated:
        w = replace(w, w13=w.w13[:, :i].contiguous())
    x = torch.randn(t, h, generator=gen).bfloat16().to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(torch.int32).to(DEVICE)
    wts = (torch.rand(t, top_k, generator=gen) + 0.1).to(DEVICE)
    tiles = (TileConfig(16, 32, 32, 1, 4, 1), TileConfig(16, 32, 32, 1, 4, 1))
    tma_tiles = tuple(replace(c, tma=True) for c in tiles)
    assert all(k.tma_weights_ok(b, c) for b, c in zip((w.w13, w.w2), tma_tiles)) == (DEVICE == "cpu" or _sm90())

    def run(configs):
        return k.fused_moe(x, ids, wts, w, activation=activation, gated=gated, configs=configs, all_local=True)

    plain, tma = run(tiles), run(tma_tiles)
    assert plain.abs().max() > 0
    assert torch.equal(plain, tma)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9


def test_weights_tma_cannot_read_fall_back_to_pointer_loads():
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tiles import TileConfig

    tile = TileConfig(16, 32, 32, tma=True)
    ok = torch.zeros(2, 64, 64, dtype=torch.bfloat16, device=DEVICE)
    assert k.tma_weights_ok(ok, tile) == (DEVICE == "cpu" or _sm90())
    assert not k.tma_weights_ok(torch.zeros(2, 64, 20, dtype=torch.bfloat16, device=DEVICE), tile)  # 40-byte rows
    assert not k.tma_weights_ok(ok.transpose(1, 2), tile)  # K not contiguous
    assert not k.tma_weights_ok(ok, replace(tile, block_n=512))  # a TMA box holds at most 256 per dim
    assert not k.tma_weights_ok(torch.zeros(2, 64, 64, dtype=torch.int8, device=DEVICE), replace(tile, block_k=8))


def test_tma_is_part_of_a_tile_and_reads_sglang_spelling():
    from moehal.kernels.tiles import TileConfig

    tile = TileConfig(128, 256, 64, 1, 8, 4, tma=True)
    assert tile.as_dict()["USE_TMA"] and TileConfig.from_dict(tile.as_dict()) == tile
    assert "USE_TMA" not in TileConfig(64, 64, 64).as_dict()  # tables without TMA read as before
    sglang = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 8}
    assert TileConfig.from_dict({**sglang, "num_stages": 4, "USE_TMA": True}) == tile
