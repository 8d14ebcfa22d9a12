"""Real kernels on a GPU: the chosen DeepGEMM pipeline against the reference, and CUDA-graph
capture. The full device report (more cases, timings) is tests/cuda/device_check.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]


def _deepgemm_usable() -> str | None:
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        return f"DeepGEMM needs SM90 or SM100; this device is sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        import deep_gemm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"deep_gemm not importable: {exc}"
    return None


def _weights(cfg, quant: str):
    import moehal

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(16, cfg.w13_rows, 512, device="cuda", generator=g) / 512**0.5
    w2 = torch.randn(16, 512, 256, device="cuda", generator=g) / 256**0.5
    b13 = torch.randn(16, cfg.w13_rows, device="cuda", generator=g) * 0.1 if cfg.has_w13_bias else None
    b2 = torch.randn(16, 512, device="cuda", generator=g) * 0.1 if cfg.has_w2_bias else None
    calib = torch.randn(64, 512, device="cuda", generator=g)  # static input scales (fp8_tensor)
    return moehal.quantize_weights(
        cfg, moehal.QuantScheme.parse(quant), w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=calib
    ).to("cuda")


def _layers(quant: str, layout: str | None, **extra):
    import moehal
    from moehal.reference.oracle import reference_layer

    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=32, **extra)
    w = _weights(cfg, quant)
    layer = moehal.MoELayer(cfg, quant, backend="cuda", device="cuda", layout=layout)
    ref = reference_layer(cfg, quant, "cuda", layout=layout)  # the pure oracle, not cuda.permute
    layer.load_weights(w)
    ref.load_weights(w)
    return cfg, layer, ref


def _inputs(cfg, t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    w, ids = torch.rand(t, cfg.num_experts, device="cuda", generator=g).topk(cfg.top_k, dim=-1)
    return x, ids.int(), (w / w.sum(-1, keepdim=True)).float()


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "fp8_tensor"])
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_deepgemm_layer_matches_reference(quant, layout, monkeypatch):
    why = _deepgemm_usable()
    if why:
        pytest.skip(why)
    from moehal_cuda.deepgemm_experts import DeepGemmExperts

    # fp8_tensor: 5 tokens run the portable fused MoE, 17 and 32 the grouped GEMMs, in one layer
    monkeypatch.setattr(DeepGemmExperts, "fp8_tensor_portable_max_tokens", 8)
    cfg, layer, ref = _layers(quant, layout, activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True)
    assert "cuda.deepgemm" in layer.plan.pipeline.name
    for step, t in enumerate((32, 5, 17)):
        x, ids, w = _inputs(cfg, t, step)
        y, yr = layer(x, ids, w), ref(x, ids, w)
        err = ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item()
        assert err < (3e-2 if quant == "bf16" else 6e-2)


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_tensor"])
def test_forward_is_graph_capturable(quant, monkeypatch):
    why = _deepgemm_usable()
    if why:
        pytest.skip(why)
    from moehal_cuda.deepgemm_experts import DeepGemmExperts

    monkeypatch.setattr(DeepGemmExperts, "fp8_tensor_portable_max_tokens", 0)  # the grouped GEMMs at 32 tokens
    cfg, layer, ref = _layers(quant, "masked")
    assert "cuda.deepgemm" in layer.plan.pipeline.name
    layer.cuda_graph_tokens = 64  # inside the caller's capture the layer must not replay its own graphs
    x, ids, w = _inputs(cfg, 32, 0)
    layer(x, ids, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        y = layer(x, ids, w)
    torch.cuda.current_stream().wait_stream(s)
    x2, ids2, w2 = _inputs(cfg, 32, 1)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    yr = ref(x, ids, w)
    assert ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item() < 6e-2


@pytest.mark.parametrize("paused", [True, False], ids=["gc_paused", "collector_on"])
def test_a_dead_cycle_holding_a_graph_cannot_break_a_capture(monkeypatch, paused):
    """An earlier layer's CUDA graphs, held by a reference cycle that has just died, and a
    capture whose allocations trigger automatic collections (threshold 1 here; in `moehal
    bench` the thresholds of the day did it, docs/device-runs/2026-11-24-session24): freeing
    the graph inside the capture invalidates it. `moehal.graphs.capture` pauses the collector,
    so the capture holds; with the collector on (the control) it breaks."""
    import contextlib
    import gc

    import moehal.graphs as G

    if not paused:
        monkeypatch.setattr(G, "gc_paused", contextlib.nullcontext)
    dev = torch.device("cuda")
    x = torch.arange(16.0, device=dev)

    class Holder:
        pass

    kept = [G.capture(lambda: x + 1, dev)[0]]  # an earlier graph

    def fn() -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            h = Holder()  # a young cycle: collected by the next generation-0 collection
            h.cycle, h.graph = h, kept.pop()
            del h  # the cycle, and the graph only it holds, are garbage from here on
            _ = [[] for _ in range(2000)]  # allocations: automatic collections at threshold 1
        return x * 2

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        if paused:
            graph, out = G.capture(fn, dev)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, x * 2)
        else:
            with pytest.raises(Exception, match="capture"):
                G.capture(fn, dev)
            # torch's own context leaves its capture stream current when the capture fails
            # (session 36); `capture` hands the caller's back
            assert torch.cuda.current_stream() == torch.cuda.default_stream()
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        torch.cuda.synchronize()


@pytest.mark.parametrize("pipeline", ["cuda.deepgemm", "cuda.triton"])
def test_eager_calls_replay_cuda_graphs(pipeline):
    """`cuda_graph_tokens`: one capture per token count, new inputs each call, outputs that
    stay the caller's, and larger batches eager."""
    if pipeline == "cuda.deepgemm" and (why := _deepgemm_usable()):
        pytest.skip(why)
    import moehal
    from moehal.bench import _pipeline_named

    cfg, _, ref = _layers("bf16", "masked")
    reg = moehal.discover()
    pipe = _pipeline_named(pipeline, cfg, moehal.QuantScheme.parse("bf16"), torch.device("cuda"), reg)
    layer = moehal.MoELayer(cfg, "bf16", device="cuda", pipeline=pipe, cuda_graph_tokens=20)
    layer.load_weights(_weights(cfg, "bf16"))
    outs = []
    for seed, t in enumerate((5, 5, 17, 5, 32)):
        x, ids, w = _inputs(cfg, t, seed)
        y = layer(x, ids, w)
        outs.append((y, y.clone(), ref(x, ids, w)))
    torch.cuda.synchronize()
    assert layer._graphs_topk.captured_token_counts == [5, 17]  # 32 > 20 ran eagerly
    cache = layer._graphs_topk

    def rel_err(y: torch.Tensor, yr: torch.Tensor) -> float:
        return ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item()

    # a caller that refills the same input tensors in place: after two calls the layer replays a
    # graph captured on them (no input copy), which must read their contents at every call
    x, ids, w = _inputs(cfg, 5, 10)
    for seed in range(11, 15):  # each output stays alive into the next call: a new address each time
        nx, nids, nw = _inputs(cfg, 5, seed)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        y = layer(x, ids, w)
        assert rel_err(y, ref(x, ids, w)) < 3e-2
        outs.append((y, y.clone(), ref(x, ids, w)))
    assert cache.direct_graphs >= 1
    writing = cache.output_writing_graphs
    # a caller that drops each result before the next call (allocated first, everything freed
    # by the next call): the output's address recurs too, and a graph captured on it writes
    # the result there (no copy out)
    for seed in range(15, 21):
        nx, nids, nw = _inputs(cfg, 5, seed)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        assert rel_err(layer(x, ids, w), ref(x, ids, w)) < 3e-2
    assert cache.output_writing_graphs > writing
    kept = layer(x, ids, w)  # a result the caller keeps: later calls must not write it
    outs.append((kept, kept.clone(), ref(x, ids, w)))
    # and with the caller's output buffer: a direct graph writes it, the call returns it. (It is
    # a new graph, or one captured above for a fresh output that the allocator put where `out`
    # now is: the same addresses, the same graph. Which one depends on the allocator's state,
    # so on the tests that ran before: session 42's call 1 saw the second.)
    writing = cache.output_writing_graphs
    out = torch.empty_like(x)
    for seed in range(21, 25):
        nx, nids, nw = _inputs(cfg, 5, seed)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        assert layer(x, ids, w, out=out) is out
        assert rel_err(out, ref(x, ids, w)) < 3e-2
    writer = cache._direct.get(cache.where((x, ids, w), out))
    assert writer is not None and writer.output is None  # replayed, writing `out` itself
    assert cache.output_writing_graphs in (writing, writing + 1)
    # `kept` holds an address a graph writes: these calls' outputs land elsewhere, are right,
    # and leave `kept` and every earlier output alone
    for seed in range(25, 29):
        nx, nids, nw = _inputs(cfg, 5, seed)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        assert rel_err(layer(x, ids, w), ref(x, ids, w)) < 3e-2
    torch.cuda.synchronize()
    for y, y_then, yr in outs:
        assert torch.equal(y, y_then), "a later replay overwrote an earlier output"
        assert rel_err(y, yr) < 3e-2


@pytest.mark.parametrize("pipeline", ["cuda.deepgemm", "cuda.triton"])
def test_in_place_calls_replay_graphs_right_from_the_capturing_call(pipeline):
    """`layer(h, ..., out=h)` with `cuda_graph_tokens`: the call that captures the graph writing
    `h` returned f(f(h)) (the capture's warm-up had overwritten the input; session 43)."""
    if pipeline == "cuda.deepgemm" and (why := _deepgemm_usable()):
        pytest.skip(why)
    import moehal
    from moehal.bench import _pipeline_named

    cfg, _, ref = _layers("bf16", "masked")
    pipe = _pipeline_named(pipeline, cfg, moehal.QuantScheme.parse("bf16"), torch.device("cuda"), moehal.discover())
    layer = moehal.MoELayer(cfg, "bf16", device="cuda", pipeline=pipe, cuda_graph_tokens=20)
    layer.load_weights(_weights(cfg, "bf16"))
    h, ids, w = _inputs(cfg, 6, 0)
    for seed in range(1, 6):
        nx, nids, nw = _inputs(cfg, 6, seed)
        h.copy_(nx), ids.copy_(nids), w.copy_(nw)
        want = ref(nx, nids, nw)
        assert layer(h, ids, w, out=h) is h
        err = ((h.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 3e-2, f"call {seed}: relative error {err:.3f}"
    assert layer._graphs_topk.output_writing_graphs == 1


@pytest.mark.parametrize("pipeline", ["cuda.deepgemm", "cuda.triton"])
def test_a_copy_made_before_loading_is_a_layer_of_its_own(pipeline):
    """copy.deepcopy of a GPU layer before load_weights (a model copied, then loaded): the copy
    builds its own runners and runs alone; a processed GPU layer refuses to copy."""
    if pipeline == "cuda.deepgemm" and (why := _deepgemm_usable()):
        pytest.skip(why)
    import copy

    import moehal
    from moehal.bench import _pipeline_named

    cfg, _, ref = _layers("bf16", "masked")
    pipe = _pipeline_named(pipeline, cfg, moehal.QuantScheme.parse("bf16"), torch.device("cuda"), moehal.discover())
    layer = moehal.MoELayer(cfg, "bf16", device="cuda", pipeline=pipe, cuda_graph_tokens=20)
    twin = copy.deepcopy(layer)
    assert twin._experts is not layer._experts and twin._order is layer._order  # one order per device
    weights = _weights(cfg, "bf16")
    layer.load_weights(weights)
    twin.load_weights(_weights(cfg, "bf16"))
    for seed, t in enumerate((3, 3, 3, 30)):  # three graph calls (capture, then replay), one eager
        x, ids, w = _inputs(cfg, t, seed)
        y = twin(x, ids, w)
        assert torch.equal(y, layer(x, ids, w))
        assert ((y.float() - ref(x, ids, w).float()).abs().max() / ref(x, ids, w).float().abs().max()) < 3e-2
    with pytest.raises(moehal.NotSupportedError, match="cannot be copied"):
        copy.deepcopy(layer)


@pytest.mark.parametrize("pipeline", ["cuda.deepgemm", "cuda.triton"])
def test_graphs_and_buffers_made_in_inference_mode_serve_calls_outside_it(pipeline):
    """An engine serves under `torch.inference_mode()`: the layer's first calls capture graphs
    and allocate its buffers there. Later calls under `torch.no_grad()` (new tensors: copied
    into the graph's static inputs) must run and stay right."""
    if pipeline == "cuda.deepgemm" and (why := _deepgemm_usable()):
        pytest.skip(why)
    import moehal
    from moehal.bench import _pipeline_named
    from moehal.kernels.triton_permute import release_workspaces

    release_workspaces("cuda")
    cfg, _, ref = _layers("bf16", "masked")
    reg = moehal.discover()
    pipe = _pipeline_named(pipeline, cfg, moehal.QuantScheme.parse("bf16"), torch.device("cuda"), reg)
    layer = moehal.MoELayer(cfg, "bf16", device="cuda", pipeline=pipe, cuda_graph_tokens=20)
    layer.load_weights(_weights(cfg, "bf16"))
    with torch.inference_mode():
        for seed, t in enumerate((5, 5, 17, 32)):
            layer(*_inputs(cfg, t, seed))
    assert layer._graphs_topk.captured_token_counts == [5, 17]
    with torch.no_grad():
        for seed, t in enumerate((5, 17, 32, 5), start=10):
            x, ids, w = _inputs(cfg, t, seed)
            y, yr = layer(x, ids, w), ref(x, ids, w)
            assert ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item() < 3e-2


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_graphs_keep_the_buffers_they_write_past_release_workspaces(layout):
    """A layer's graph captured at a token count whose buffers the layer fetches per call
    (contiguous prefill, dispatches past `KEEP_BOUND_TOKENS`) writes them at every replay.
    `release_workspaces` forgets them, and memory allocated after it could take their place:
    the graph keeps them, so its replays stay right."""
    if why := _deepgemm_usable():
        pytest.skip(why)
    import gc
    import weakref

    import moehal
    from moehal.kernels import triton_permute as tp
    from moehal.reference.oracle import reference_layer
    from moehal_cuda.dispatch import KEEP_BOUND_TOKENS

    t = KEEP_BOUND_TOKENS + 8
    tp.release_workspaces("cuda")
    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=t)
    layer = moehal.MoELayer(cfg, "bf16", backend="cuda", device="cuda", layout=layout, cuda_graph_tokens=t)
    ref = reference_layer(cfg, "bf16", "cuda", layout=layout)
    for m in (layer, ref):
        m.load_weights(_weights(cfg, "bf16"))
    x, ids, w = _inputs(cfg, t, 0)
    first = layer(x, ids, w).clone()  # captures
    assert layer._graphs_topk.captured_token_counts == [t]
    fetched = [weakref.ref(b) for b in (*tp._WORKSPACE.values(), *tp._SCRATCH.values())]
    tp.release_workspaces("cuda")
    gc.collect()
    assert all(r() is not None for r in fetched), "a buffer the graph writes was freed"
    junk = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(64)]  # where freed blocks would go
    x2, ids2, w2 = _inputs(cfg, t, 1)  # new tensors: copied into the graph's inputs, and it replays
    y, yr = layer(x2, ids2, w2), ref(x2, ids2, w2)
    assert layer._graphs_topk.captured_token_counts == [t] and not torch.equal(y, first)
    assert ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item() < 3e-2
    assert all(torch.isnan(j).all() for j in junk), "a replay wrote memory handed out after the release"


def test_the_contiguous_path_first_run_in_inference_mode_serves_calls_outside_it():
    """The contiguous path keeps DeepGEMM's segment ends across calls and adds into them in
    place: allocated in inference mode, the next call under `no_grad` raised there."""
    if why := _deepgemm_usable():
        pytest.skip(why)
    from moehal.kernels.triton_permute import release_workspaces

    release_workspaces("cuda")
    with torch.inference_mode():
        cfg, layer, ref = _layers("bf16", "contiguous")
        x, ids, w = _inputs(cfg, 9, 0)
        served = layer(x, ids, w)
    with torch.no_grad():
        assert torch.equal(layer(x, ids, w), served)
        x, ids, w = _inputs(cfg, 9, 1)
        y, yr = layer(x, ids, w), ref(x, ids, w)
        assert ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item() < 3e-2


@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_prefill_batches_run_the_portable_fused_moe(monkeypatch, quant):
    """Prefill batches (forced here from 16 tokens) run the portable Triton fused MoE on the
    DeepGEMM experts' own weights (fp8: and their block scales), decode batches the token-major
    kernels (bf16 only) and the batches between the masked grouped GEMMs, on one layer,
    eagerly and replayed from CUDA graphs."""
    why = _deepgemm_usable()
    if why:
        pytest.skip(why)
    from moehal_cuda.deepgemm_experts import DeepGemmExperts

    monkeypatch.setattr(DeepGemmExperts, "small_batch_max_tokens", 2)
    monkeypatch.setattr(DeepGemmExperts, "portable_prefill_min_tokens", 16)
    cfg, layer, ref = _layers(quant, None, activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True)
    small = layer.plan.pipeline.small
    assert small is not None and small.prefill_min_tokens == 16 and layer.plan.pipeline.fmt.layout_name == "masked"
    assert small.max_tokens == (2 if quant == "bf16" else 0)
    for graphs in (0, 32):
        layer.cuda_graph_tokens = graphs
        for step, t in enumerate((32, 1, 8, 16, 2, 20, 5)):
            x, ids, w = _inputs(cfg, t, 200 * graphs + step)
            y, yr = layer(x, ids, w), ref(x, ids, w)
            err = ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item()
            assert err < (3e-2 if quant == "bf16" else 6e-2), f"{t} tokens, graphs {graphs}: rel err {err:.4f}"


def test_small_batches_run_token_major(monkeypatch):
    """bf16 decode batches take the token-major kernels, larger ones the masked path, on one
    layer, eagerly and replayed from CUDA graphs (limit raised to 4 tokens to check several)."""
    why = _deepgemm_usable()
    if why:
        pytest.skip(why)
    from moehal_cuda.deepgemm_experts import DeepGemmExperts

    monkeypatch.setattr(DeepGemmExperts, "small_batch_max_tokens", 4)
    cfg, layer, ref = _layers("bf16", None, activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True)
    small = layer.plan.pipeline.small
    assert small is not None and small.max_tokens == 4 and layer.plan.pipeline.fmt.layout_name == "masked"
    for graphs in (0, 8):
        layer.cuda_graph_tokens = graphs
        for step, t in enumerate((1, 4, 32, 2, 5, 1, 3)):
            x, ids, w = _inputs(cfg, t, 100 * graphs + step)
            y, yr = layer(x, ids, w), ref(x, ids, w)
            err = ((y.float() - yr.float()).abs().max() / yr.float().abs().max()).item()
            assert err < 3e-2, f"{t} tokens, graphs {graphs}: rel err {err:.4f}"
