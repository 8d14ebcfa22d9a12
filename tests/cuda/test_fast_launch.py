"""Fast Triton launches on a GPU (`moehal.kernels.launch`): a layer's forward gives the same
bits with and without them, its launches after the first take the compiled launcher, and from
the third forward on its bound launches are pinned (`launch.site`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]


def _launchers():
    from moehal.kernels import launch, triton_fused_moe, triton_grouped_gemm, triton_permute, triton_token_moe
    from moehal_cuda import triton_glue

    mods = (triton_permute, triton_token_moe, triton_grouped_gemm, triton_fused_moe, triton_glue)
    return [v for m in mods for v in vars(m).values() if isinstance(v, launch.Launcher)]


@pytest.mark.parametrize("backend", ["cuda", "cuda.triton"])
@pytest.mark.parametrize("tokens", [2, 16, 96])
def test_fast_launches_give_the_same_bits_as_tritons_path(backend, tokens, monkeypatch, registry):
    import moehal
    from moehal.kernels import launch

    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=128)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = torch.randn(16, cfg.w13_rows, 512, device="cuda", generator=g) / 512**0.5
    w2 = torch.randn(16, 512, 256, device="cuda", generator=g) / 256**0.5
    pipe = None
    if backend == "cuda.triton":  # the portable fused MoE (prefill-sized batches use it too)
        from moehal.bench import _pipeline_named

        pipe = _pipeline_named(backend, cfg, moehal.QuantScheme.parse("bf16"), torch.device("cuda"), registry)
    layer = moehal.MoELayer(cfg, "bf16", backend="cuda", device="cuda", registry=registry, pipeline=pipe)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13, w2))
    x = torch.randn(tokens, 512, device="cuda", generator=g).bfloat16()
    wts, ids = torch.rand(tokens, 16, device="cuda", generator=g).topk(4, dim=-1)
    ids, wts = ids.int(), (wts / wts.sum(-1, keepdim=True)).float()

    monkeypatch.setattr(launch, "ENABLED", False)
    want = layer(x, ids, wts).clone()
    monkeypatch.setattr(launch, "ENABLED", True)
    layer(x, ids, wts)  # keys seen for the first time: Triton's path
    before = sum(k.hits for k in _launchers())
    got = layer(x, ids, wts)  # VERIFY is on (conftest): each hit is checked against Triton's choice
    torch.cuda.synchronize()
    assert sum(k.hits for k in _launchers()) > before, f"no fast launch in {layer.plan.pipeline.name}"
    assert torch.equal(got, want)
    # the bound launches pinned at the second forward; the third takes them, each checked (VERIFY)
    pinned = sum(k.pinned for k in _launchers())
    again = layer(x.clone(), ids.clone(), wts.clone())
    torch.cuda.synchronize()
    assert sum(k.pinned for k in _launchers()) > pinned, f"no pinned launch in {layer.plan.pipeline.name}"
    assert torch.equal(again, want)


@pytest.mark.parametrize("weights", ["bf16", "bf16 paired", "fp8_block"])
def test_the_fused_moe_reads_weights_by_tma_through_fast_launches(weights, monkeypatch):
    """The portable fused MoE with TMA weight tiles (an H200's tuned tiles at Qwen3-30B-A3B's
    64-724 tokens): both GEMMs, whose descriptors are bound once, take the compiled launcher
    (checked against Triton's choice: VERIFY) and give the bits Triton's path gives."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA weight tiles need SM90 or newer")
    from dataclasses import replace

    from moehal.kernels import launch
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tiles import TileConfig

    e, h, i, top_k, t = 16, 512, 256, 4, 96
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=g) / i**0.5
    tiles = (TileConfig(64, 64, 64, 8, 4, 3, True), TileConfig(64, 128, 64, 8, 4, 3, True))
    if weights == "fp8_block":
        f8 = torch.float8_e4m3fn
        w = k.TritonMoEWeights(
            w13.to(f8), w2.to(f8), "fp8_block", torch.ones(e, 2 * i // 128, h // 128, device="cuda"),
            torch.ones(e, h // 128, i // 128, device="cuda"),
        )  # fmt: skip
        tiles = tuple(replace(c, block_k=128) for c in tiles)
    elif weights == "bf16 paired":
        w = k.TritonMoEWeights(k.pair_gate_up(w13.bfloat16()), w2.bfloat16(), w13_paired=True)
    else:
        w = k.TritonMoEWeights(w13.bfloat16(), w2.bfloat16())
    bound = k.bind_fused_moe(t, top_k, w, configs=tiles)
    assert bound.gemm1.kw["B_TMA"] and bound.gemm2.kw["B_TMA"]
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    wts, ids = torch.rand(t, e, device="cuda", generator=g).topk(top_k, dim=-1)
    monkeypatch.setattr(launch, "ENABLED", False)
    want = bound(x, ids.int(), wts).clone()
    monkeypatch.setattr(launch, "ENABLED", True)
    bound(x, ids.int(), wts)  # keys seen for the first time: Triton's path
    before = k._fused_moe_kernel.hits
    got = bound(x.clone(), ids.int(), wts.clone())  # new tensors, same launches
    torch.cuda.synchronize()
    assert k._fused_moe_kernel.hits == before + 2, "both GEMMs' launches take the compiled launcher"
    assert torch.equal(got, want)
