"""Host-side weight transforms of the SM100 FlashInfer paths, against their documented index
formulas (the kernels need SM100; these run anywhere)."""

from __future__ import annotations

import pytest
import torch
from moehal.config import MoEConfig
from moehal.quant import FP8_BLOCK, FP8_TENSOR, NVFP4, nvfp4
from moehal.weights import quantize_weights
from moehal_cuda import flashinfer_layouts as L
from moehal_cuda.flashinfer_moe import prepare_cutedsl_nvfp4, prepare_trtllm_fp8_block, prepare_trtllm_fp8_tensor


def test_swap_halves_is_an_involution_and_moves_up_first():
    w = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    s = L.swap_w13_halves(w)
    assert torch.equal(s[:, :3], w[:, 3:]) and torch.equal(s[:, 3:], w[:, :3])
    assert torch.equal(L.swap_w13_halves(s), w)


def test_gated_act_reorder_interleaves_halves():
    w = torch.arange(8)[:, None].expand(8, 2)
    r = L.reorder_rows_for_gated_act(w)[:, 0].tolist()
    assert r == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("tile,block", [(64, 16), (128, 32)])
def test_epilogue_shuffle_follows_the_row_map(tile, block):
    m = 2 * block
    idx = L.shuffle_row_indices(m, tile)
    assert sorted(idx.tolist()) == list(range(m))  # a permutation
    # source row i of each block lands at destination 8*(i % (block/8)) + i // (block/8)
    per = block // 8
    for old in range(m):
        b, i = divmod(old, block)
        new = b * block + (i % per) * 8 + i // per
        assert idx[new] == old
    w = torch.arange(m * 3).reshape(m, 3)
    assert torch.equal(L.shuffle_rows_for_epilogue(w, tile), w[idx])


def test_block_scale_swizzle_formula_and_roundtrip():
    m, k = 200, 10  # pads to 256 x 12
    sf = torch.randint(1, 255, (3, m, k), dtype=torch.uint8)
    flat = L.swizzle_block_scales_128x4(sf)
    assert flat.shape == (3, 256 * 12)
    kt_n = 12 // 4
    for mm, kk in [(0, 0), (37, 3), (130, 9), (199, 5)]:
        mt, r = divmod(mm, 128)
        r4, r32 = divmod(r, 32)
        kt, k4 = divmod(kk, 4)
        off = (((mt * kt_n + kt) * 32 + r32) * 4 + r4) * 4 + k4
        assert flat[1, off] == sf[1, mm, kk]
    assert torch.equal(L.unswizzle_block_scales_128x4(flat, m, k), sf)
    padded = L.unswizzle_block_scales_128x4(flat, 256, 12)
    assert (padded[:, m:] == 0).all() and (padded[:, :, k:] == 0).all()


def test_interleave_w13_halves_in_64_row_chunks_roundtrip():
    w = torch.arange(2 * 256 * 2).reshape(2, 256, 2)
    iv = L.interleave_w13_halves(w, 64)
    for c in range(2):
        assert torch.equal(iv[:, 128 * c : 128 * c + 64], w[:, 64 * c : 64 * c + 64])
        assert torch.equal(iv[:, 128 * c + 64 : 128 * c + 128], w[:, 128 + 64 * c : 128 + 64 * c + 64])
    assert torch.equal(L.deinterleave_w13_halves(iv, 64), w)


def _cfg(**kw):
    return MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, **kw)


def test_trtllm_fp8_block_weights_keep_the_math():
    cfg = _cfg()
    g = torch.Generator().manual_seed(0)
    w = quantize_weights(cfg, FP8_BLOCK, torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g))
    t = prepare_trtllm_fp8_block(w)
    from moehal.quant import fp8

    deq = fp8.dequantize_block(t.w13, t.w13_scale)
    ref = fp8.dequantize_block(w.w13, w.w13_scale)
    assert torch.equal(deq, L.swap_w13_halves(ref))  # [w3; w1]: same numbers, halves swapped


def test_trtllm_fp8_tensor_scales_fold_static_scales():
    cfg = _cfg()
    g = torch.Generator().manual_seed(1)
    w = quantize_weights(cfg, FP8_TENSOR, torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g))
    t = prepare_trtllm_fp8_tensor(w)
    torch.testing.assert_close(t.out1_gate_scale, w.a13_scale * w.w13_scale)
    torch.testing.assert_close(t.out1_scale * w.a2_scale, w.a13_scale * w.w13_scale)
    torch.testing.assert_close(t.out2_scale, w.a2_scale * w.w2_scale)
    # rows: swap -> gated interleave -> epilogue shuffle, a permutation of the canonical rows
    perm = L.gated_act_row_indices(256)[L.shuffle_row_indices(256, 128)]
    swapped = L.swap_w13_halves(w.w13).view(torch.uint8)
    assert torch.equal(t.w13.view(torch.uint8), swapped[:, perm])
    # W2 row-shuffled for the epilogue tile too (no swap, no interleave), as FlashInfer's trtllm
    # tests shuffle gemm2's weights with shuffle_matrix_a
    assert torch.equal(t.w2.view(torch.uint8), w.w2.view(torch.uint8)[:, L.shuffle_row_indices(256, 128)])


@pytest.mark.parametrize("standard", [True, False])
def test_cutedsl_nvfp4_preparation_is_lossless(standard):
    cfg = _cfg()
    g = torch.Generator().manual_seed(2)
    w = quantize_weights(cfg, NVFP4, torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g))
    p = prepare_cutedsl_nvfp4(w, standard)
    s13 = L.unswizzle_block_scales_128x4(p.w13_sf.view(torch.uint8), 256, 256 // 16).view(torch.float8_e4m3fn)
    w13 = p.w13
    if standard:
        w13 = L.swap_w13_halves(L.deinterleave_w13_halves(w13))
        s13 = L.swap_w13_halves(L.deinterleave_w13_halves(s13))
    torch.testing.assert_close(
        nvfp4.dequantize(w13, s13, w.w13_global_scale[:, None]),
        nvfp4.dequantize(w.w13, w.w13_scale, w.w13_global_scale[:, None]),
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(p.w13_alpha, 1.0 / (w.a13_scale * w.w13_global_scale))


@pytest.mark.parametrize("standard", [True, False])
def test_cutedsl_nvfp4_w2_scales_are_swizzled_and_its_alpha_uses_the_gemm2_input_scale(standard):
    """W2's block scales in the 128x4-swizzled layout (both paths), and
    w2_alpha = 1 / (a2_global_scale * w2_global_scale): GEMM2's own input scale, calibrated
    here so that a2 differs from a13."""
    cfg = _cfg()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=g)
    w = quantize_weights(
        cfg, NVFP4, torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g), calibration_input=x
    )
    assert not torch.allclose(w.a2_scale, w.a13_scale)
    p = prepare_cutedsl_nvfp4(w, standard)
    assert p.w2_sf.shape == (4, 256 * (128 // 16))
    assert torch.equal(
        L.unswizzle_block_scales_128x4(p.w2_sf.view(torch.uint8), 256, 128 // 16), w.w2_scale.view(torch.uint8)
    )
    assert torch.equal(p.w2.view(torch.uint8), w.w2.view(torch.uint8))
    torch.testing.assert_close(p.w2_alpha, 1.0 / (w.a2_scale * w.w2_global_scale))
    torch.testing.assert_close(p.w13_alpha, 1.0 / (w.a13_scale * w.w13_global_scale))
