"""GEMM1 on paired weights (`TritonMoEWeights.w13_paired`: gate and up rows interleaved, one dot
per K step) computes what the canonical two-dot GEMM1 computes. In CI the interpreter runs it; on
a GPU the same tests run compiled (pointer loads and TMA tiles alike)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _rocm_testing import DEVICE, needs_triton

pytestmark = needs_triton


def test_pairing_interleaves_gate_and_up_rows():
    from moehal.kernels.triton_fused_moe import pair_gate_up

    e, i, h = 2, 3, 4
    w13 = torch.arange(e * 2 * i * h, dtype=torch.float32).reshape(e, 2 * i, h)
    p = pair_gate_up(w13)
    assert p.shape == w13.shape and p.is_contiguous()
    for j in range(i):
        assert torch.equal(p[:, 2 * j], w13[:, j])  # gate row j
        assert torch.equal(p[:, 2 * j + 1], w13[:, i + j])  # up row j
    strided = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert torch.equal(pair_gate_up(strided), p)


def _case(gen: torch.Generator, e: int = 4, h: int = 128, i: int = 48, t: int = 9, top_k: int = 2):
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).bfloat16().to(DEVICE)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).bfloat16().to(DEVICE)
    b13 = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(DEVICE)
    x = torch.randn(t, h, generator=gen).bfloat16().to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(torch.int32).to(DEVICE)
    wts = (torch.rand(t, top_k, generator=gen) + 0.1).to(DEVICE)
    return w13, w2, b13, x, ids, wts


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_paired_gemm1_equals_canonical(activation, tma, bias):
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tiles import TileConfig

    gen = torch.Generator().manual_seed(2)
    w13, w2, b13, x, ids, wts = _case(gen)  # I = 48: the last 32-wide N tile is ragged
    canon = k.TritonMoEWeights(w13, w2, w13_bias=b13 if bias else None)
    paired = replace(canon, w13=k.pair_gate_up(w13), w13_paired=True)
    tiles = (TileConfig(16, 32, 32, 1, 4, 1, tma), TileConfig(16, 32, 32, 1, 4, 1))

    def run(w):
        return k.fused_moe(x, ids, wts, w, activation=activation, configs=tiles, all_local=True)

    want, got = run(canon), run(paired)
    assert want.abs().max() > 0
    # One [BM, 2BN] dot against two [BM, BN] dots: the same products, summed in an order the
    # matmul may choose per shape, so the bf16 outputs agree to within a rounding step.
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-3)
    # and the test can tell gate from up: pairing [up; gate] computes something else
    swapped = replace(paired, w13=k.pair_gate_up(torch.cat([w13[:, 48:], w13[:, :48]], dim=1)))
    assert (run(swapped) - want).abs().max() > 0.1 * want.abs().max()


def test_the_weight_processor_pairs_unquantized_gated_weights_only():
    import moehal
    from moehal.interfaces import BuildRequest
    from moehal.kernels.triton_experts import TritonWeightProcessor

    proc = TritonWeightProcessor(devices=frozenset({torch.device(DEVICE).type}))
    hw = moehal.hardware.detect(DEVICE)
    for quant, gated, paired in (("bf16", True, True), ("bf16", False, False), ("fp8_block", True, False)):
        cfg = moehal.MoEConfig(
            num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, gated=gated,
            activation="silu" if gated else "gelu",
        )  # fmt: skip
        scheme = moehal.QuantScheme.parse(quant)
        gen = torch.Generator().manual_seed(0)
        w13 = torch.randn(4, cfg.w13_rows, 128, generator=gen).to(DEVICE)
        w2 = torch.randn(4, 128, 128, generator=gen).to(DEVICE)
        w = proc.process(moehal.quantize_weights(cfg, scheme, w13, w2), BuildRequest(cfg, scheme, hw))
        assert w.w13_paired is paired, (quant, gated)


def test_paired_weights_must_be_unquantized():
    from moehal.kernels import triton_fused_moe as k

    gen = torch.Generator().manual_seed(3)
    w13, w2, _, x, ids, wts = _case(gen)
    fp8 = k.TritonMoEWeights(
        w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), "fp8_block",
        torch.ones(4, 1, 1, device=DEVICE), torch.ones(4, 1, 1, device=DEVICE), w13_paired=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="unquantized gated"):
        k.fused_moe(x, ids, wts, fp8)
