"""Fast Triton launches on a GPU (`moehal.kernels.launch`): a layer's forward gives the same
bits with and without them, and its launches after the first take the compiled launcher."""

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
