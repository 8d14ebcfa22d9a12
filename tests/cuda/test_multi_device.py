"""Layers on a GPU other than the current one, as a model spread over GPUs in one process
(transformers' `device_map="auto"`) calls them: Triton launches on the current device, so the
layer makes its own device current while a forward queues (`moehal.stream_order`). Needs two
GPUs; `tools/other_device_probe.py` shows what a forward did without that. DeepGEMM runs on
one GPU per process (`moehal_cuda.support.deep_gemm_device_decision`): these tests build their
DeepGEMM layers on cuda:0, as the other GPU tests of the process do."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _layer_pair(device: str):
    """The `cuda` layer on `device` and the reference oracle on the CPU, with one set of weights."""
    import moehal
    from moehal.reference.oracle import reference_layer

    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=32)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(16, cfg.w13_rows, 512, generator=g) / 512**0.5
    w2 = torch.randn(16, 512, 256, generator=g) / 256**0.5
    weights = moehal.quantize_weights(cfg, moehal.QuantScheme.parse("bf16"), w13, w2)
    layer = moehal.MoELayer(cfg, "bf16", backend="cuda", device=device)
    layer.load_weights(weights.to(device))
    ref = reference_layer(cfg, "bf16", "cpu")
    ref.load_weights(weights)
    return cfg, layer, ref


def _inputs(cfg, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, cfg.hidden_size, generator=g).bfloat16()
    w, ids = torch.rand(t, cfg.num_experts, generator=g).topk(cfg.top_k, dim=-1)
    return x, ids.int(), (w / w.sum(-1, keepdim=True)).float()


def _err(y: torch.Tensor, yr: torch.Tensor) -> float:
    return ((y.float().cpu() - yr.float()).abs().max() / yr.float().abs().max()).item()


def test_a_layer_on_another_gpu_than_the_current_one_runs_on_its_own():
    # The layer on cuda:0 (where the other GPU tests build theirs: DeepGEMM's kernels stay on the
    # GPU that first ran them), called while cuda:1 is current.
    torch.cuda.set_device(1)
    try:
        cfg, layer, ref = _layer_pair("cuda:0")
        assert torch.cuda.current_device() == 1  # building and loading left the caller's device current
        for step, t in enumerate((1, 16, 32, 1)):  # the token-major decode path, the masked pipeline, again
            x, ids, w = _inputs(cfg, t, step)
            y = layer(x.to("cuda:0"), ids.to("cuda:0"), w.to("cuda:0"))
            assert torch.cuda.current_device() == 1
            assert y.device == torch.device("cuda", 0)
            assert _err(y, ref(x, ids, w)) < 3e-2, (t, layer.plan.pipeline.name)
    finally:
        torch.cuda.set_device(0)


def test_layers_of_one_shape_on_two_gpus_take_turns():
    """On the second GPU, DeepGEMM declines (its kernels are loaded on the first: sgl-deep-gemm
    keeps one kernel cache per process), and the layer runs the next experts kernel."""
    torch.cuda.set_device(0)
    cfg, on0, ref = _layer_pair("cuda:0")
    _, on1, _ = _layer_pair("cuda:1")
    assert "cuda.deepgemm" in on0.plan.pipeline.name and "cuda.deepgemm" not in on1.plan.pipeline.name
    assert any("loaded on cuda:0" in d.reason for d in on1.plan.decisions), on1.plan
    for step, t in enumerate((1, 16, 1, 16)):
        x, ids, w = _inputs(cfg, t, step)
        want = ref(x, ids, w)
        for layer, dev in ((on0, "cuda:0"), (on1, "cuda:1"), (on0, "cuda:0")):
            assert _err(layer(x.to(dev), ids.to(dev), w.to(dev)), want) < 3e-2, (t, dev)


def test_inputs_on_another_gpu_than_the_layer_are_refused():
    import moehal

    cfg, layer, _ = _layer_pair("cuda:0")
    x, ids, w = _inputs(cfg, 4, 0)
    with pytest.raises(moehal.InputError, match="hidden_states is on cuda:1; the layer is on cuda:0"):
        layer(x.to("cuda:1"), ids.to("cuda:1"), w.to("cuda:1"))


def test_weights_on_another_gpu_than_the_layer_are_refused():
    import moehal

    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=32)
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(16, cfg.w13_rows, 512, generator=g), torch.randn(16, 512, 256, generator=g)
    weights = moehal.quantize_weights(cfg, moehal.QuantScheme.parse("bf16"), w13, w2)
    layer = moehal.MoELayer(cfg, "bf16", backend="cuda", device="cuda:0")
    with pytest.raises(moehal.WeightError, match="is on cuda:1, the layer is on cuda:0"):
        layer.load_weights(weights.to("cuda:1"))


def test_runners_are_built_with_the_layers_gpu_current(monkeypatch):
    """Runners that allocate when built (FlashInfer's CuteDSL wrapper, DeepEP's buffers) do so on
    the current device: a layer on cuda:1 built while cuda:0 is current builds them with cuda:1
    current, and leaves cuda:0 current. So does a copy of the layer."""
    import copy

    import moehal
    from moehal.layer import MoELayer

    seen: list[int] = []
    build = MoELayer._build_runners

    def spy(self):
        seen.append(torch.cuda.current_device())
        build(self)

    monkeypatch.setattr(MoELayer, "_build_runners", spy)
    torch.cuda.set_device(0)
    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=32)
    layer = moehal.MoELayer(cfg, "bf16", backend="cuda", device="cuda:1")
    copy.deepcopy(layer)  # weights not loaded: the copy builds its runners again
    assert seen == [1, 1] and torch.cuda.current_device() == 0
