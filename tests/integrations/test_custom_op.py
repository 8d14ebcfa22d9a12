"""moehal::moe_forward as a custom op: torch.compile(fullgraph=True) without graph breaks,
fake-tensor checks at trace time, and CUDA-graph capture on a GPU."""

from __future__ import annotations

import gc
import os

import moehal
import pytest
import torch
from moehal.integrations import custom_op

H, INTER, E, K = 32, 16, 6, 2


def _layer(dtype=torch.float32, routing=None, device="cpu", registry=None, backend="auto", seed=0):
    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, dtype=dtype, routing=routing)
    layer = moehal.MoELayer(cfg, device=device, registry=registry, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
    w13, w2 = w13.to(dtype), w2.to(dtype)
    layer.load_weights(w13=w13.to(device), w2=w2.to(device))
    return layer, w13.float(), w2.float()


def _float64_moe(x, ids, wts, w13, w2):
    """Independent oracle: loop over tokens and k in float64."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            g, u = h[:INTER], h[INTER:]
            out[t] += float(wts[t, k]) * (w2[e].double() @ (g * torch.sigmoid(g) * u))
    return out


class TinyMoEModel(torch.nn.Module):
    """Router + moehal layer + residual, twice: what an engine's decoder MLP looks like."""

    def __init__(self, use_logits: bool = False) -> None:
        super().__init__()
        routing = moehal.RoutingConfig("softmax", renormalize=True) if use_logits else None
        self.use_logits = use_logits
        self.routers = torch.nn.ModuleList(torch.nn.Linear(H, E) for _ in range(2))
        built = [_layer(routing=routing, seed=s) for s in range(2)]
        self.moes = torch.nn.ModuleList(b[0] for b in built)
        self.raw = [(b[1], b[2]) for b in built]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for router, moe in zip(self.routers, self.moes):
            logits = router(x)
            if self.use_logits:
                x = x + moe(x, router_logits=logits)
            else:
                w, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
                x = x + moe(x, ids, w / w.sum(-1, keepdim=True))
        return torch.tanh(x)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_op_is_registered_and_fake_is_consistent():
    layer, *_ = _layer()
    x = torch.randn(5, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(5)])
    w = torch.rand(5, K)
    # opcheck runs the real op, the fake op and schema checks against each other.
    torch.library.opcheck(torch.ops.moehal.moe_forward.default, (x, ids, w, layer._op_id))
    out = torch.ops.moehal.moe_forward(x, ids, w, layer._op_id)
    torch.testing.assert_close(out, layer(x, ids, w), rtol=0, atol=0)


@pytest.mark.parametrize("use_logits", [False, True])
def test_compiled_model_has_no_graph_break_and_matches_eager(use_logits):
    torch.manual_seed(0)
    model = TinyMoEModel(use_logits).eval()
    x = torch.randn(7, H)
    with torch.no_grad():
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        op = "moehal.moe_forward_logits" if use_logits else "moehal.moe_forward"
        targets = [str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert targets.count(op) == 2, targets
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
        torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
        x2 = torch.randn(11, H)  # another token count through the same (dynamic) graph
        torch.testing.assert_close(compiled(x2), model(x2), rtol=0, atol=0)


def test_compiled_layer_matches_float64_oracle_under_inductor():
    layer, w13, w2 = _layer()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(9)])
    wts = torch.rand(9, K, generator=gen)

    def f(x, ids, wts):
        return layer(x * 2.0, ids, wts) * 0.5

    with torch.no_grad():
        out = torch.compile(f, fullgraph=True)(x, ids, wts)
    torch.testing.assert_close(out.double(), 0.5 * _float64_moe(2.0 * x, ids, wts, w13, w2), rtol=1e-4, atol=1e-5)


def test_fake_impl_rejects_bad_shapes_at_trace_time():
    layer, *_ = _layer()
    x = torch.randn(4, H)
    ids = torch.zeros(4, K + 1, dtype=torch.int64)
    w = torch.rand(4, K + 1)
    with pytest.raises(Exception, match=r"topk_ids and topk_weights must be \[T, 2\]"):
        torch.compile(lambda a, b, c: layer(a, b, c), fullgraph=True, backend="eager")(x, ids, w)
    with pytest.raises(Exception, match="dtype is torch.bfloat16"):
        torch.compile(lambda a, b, c: layer(a, b, c), fullgraph=True, backend="eager")(
            x.bfloat16(), ids[:, :K], w[:, :K]
        )


@pytest.mark.parametrize(
    ("tokens", "out"),
    [(4, torch.zeros(4, H, dtype=torch.float64)), (1, torch.zeros(4, H)), (1, torch.zeros(H)), (1, torch.zeros(()))],
    ids=["float64-for-float32", "more-rows", "one-dim", "zero-dim"],
)
def test_compiled_calls_check_out_as_eager_does(tokens, out):
    """A wrong `out=` was filled silently under torch.compile (one of another dtype, or one row
    broadcast into all), while eager raises InputError."""
    layer, *_ = _layer()
    x, ids, w = torch.randn(tokens, H), torch.zeros(tokens, K, dtype=torch.int64), torch.rand(tokens, K)
    with pytest.raises(moehal.InputError, match="out must be"):
        layer(x, ids, w, out=out)
    with pytest.raises(Exception, match="out must be"):
        torch.compile(lambda a, b, c, o: layer(a, b, c, out=o), fullgraph=True, backend="eager")(x, ids, w, out)


def test_fake_impl_needs_loaded_weights():
    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, dtype=torch.float32)
    layer = moehal.MoELayer(cfg, device="cpu")
    x, ids, w = torch.randn(3, H), torch.zeros(3, K, dtype=torch.int64), torch.rand(3, K)
    with pytest.raises(Exception, match="load_weights"):
        torch.compile(lambda a, b, c: layer(a, b, c), fullgraph=True, backend="eager")(x, ids, w)


def test_registry_holds_weak_references():
    layer, *_ = _layer()
    layer_id = layer._op_id
    assert custom_op.get_layer(layer_id) is layer
    del layer
    gc.collect()
    with pytest.raises(moehal.MoEHalError, match="garbage collected"):
        custom_op.get_layer(layer_id)


def test_deepcopy_gets_its_own_op_id():
    # a copy that kept the original's id would run the original's weights once compiled
    import copy

    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, dtype=torch.float32)
    a = moehal.MoELayer(cfg, device="cpu")
    b = copy.deepcopy(a)  # e.g. a model copied before its weights are loaded
    assert b._op_id != a._op_id and custom_op.get_layer(b._op_id) is b
    gen = torch.Generator().manual_seed(3)
    for layer in (a, b):
        layer.load_weights(w13=torch.randn(E, 2 * INTER, H, generator=gen), w2=torch.randn(E, H, INTER, generator=gen))
    x, w = torch.randn(4, H, generator=gen), torch.rand(4, K, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(4)])
    with torch.no_grad():
        compiled = torch.compile(lambda x, i, w: b(x, i, w), fullgraph=True, backend="eager")(x, ids, w)
        torch.testing.assert_close(compiled, b(x, ids, w), rtol=0, atol=0)
        assert not torch.allclose(compiled, a(x, ids, w))


# (config.patch, not monkeypatch: pytest 9.2's monkeypatch deletes a torch config key as it undoes)
@torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)
def test_regional_compile_with_unspec_ids_is_one_graph():
    # one decoder block compiled for many layers: with the ids as graph inputs, one graph serves
    # all of them (the fake impls read a symbolic id's example value, adding no guard)
    routing = moehal.RoutingConfig("softmax", renormalize=True)

    class Block(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.router = torch.nn.Linear(H, E)
            self.moe = _layer(routing=routing, seed=seed)[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.moe(x, router_logits=self.router(x))

    blocks = [Block(s) for s in range(10)]  # more than Dynamo's recompile limit (8)
    graphs = []

    def count(gm, _example):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for b in blocks:
            want = b(x)
            b.compile(fullgraph=True, backend=count, dynamic=True)
            torch.testing.assert_close(b(x), want, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1


# --- GPU: CUDA-graph capture -----------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda unavailable)")


def _gpu_registry(backend):
    """'auto': the installed plugins; 'acme': the example plugin's source registered directly
    (sync-free, declares graph_capturable, so the capture is always exercised on a GPU)."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    if backend == "acme" and "acme" not in reg.loaded_backends():
        import importlib
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "acme_plugin" / "src"))
        try:
            reg.register(importlib.import_module("acme_moehal.plugin"), "acme")
        finally:
            sys.path.pop(0)
    return reg


def _capturable_gpu_layer(backend, dtype=torch.bfloat16):
    layer, w13, w2 = _layer(dtype=dtype, device="cuda", registry=_gpu_registry(backend), backend=backend)
    if not custom_op.is_graph_capturable(layer):
        pytest.skip(f"the selected pipeline {layer.plan.pipeline.name} does not declare graph_capturable")
    return layer, w13, w2


GPU_BACKENDS = pytest.mark.parametrize("backend", ["auto", "acme"])


@pytest.mark.gpu
@needs_cuda
@GPU_BACKENDS
def test_layer_forward_captures_into_cuda_graph(backend):
    layer, w13, w2 = _capturable_gpu_layer(backend)
    t = 16
    gen = torch.Generator().manual_seed(1)
    static_x = torch.zeros(t, H, dtype=torch.bfloat16, device="cuda")
    static_ids = torch.zeros(t, K, dtype=torch.int32, device="cuda")
    static_w = torch.zeros(t, K, dtype=torch.float32, device="cuda")

    def fill(seed):
        g = gen.manual_seed(seed)
        static_x.copy_(torch.randn(t, H, generator=g))
        static_ids.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]))
        static_w.copy_(torch.rand(t, K, generator=g))

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (lazy inits, autotuning)
        for _ in range(2):
            layer(static_x, static_ids, static_w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_ids, static_w)
    for seed in (5, 6):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        want = _float64_moe(static_x.cpu().float(), static_ids.cpu(), static_w.cpu(), w13, w2)
        torch.testing.assert_close(static_out.cpu().double(), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(static_out, layer(static_x, static_ids, static_w), rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
@GPU_BACKENDS
def test_compiled_model_runs_as_cuda_graph_on_gpu(backend):
    from torch._dynamo.utils import counters

    layer, w13, w2 = _capturable_gpu_layer(backend)
    router = torch.nn.Linear(H, E, device="cuda", dtype=torch.bfloat16)

    def f(x):
        w, ids = torch.topk(torch.softmax(router(x).float(), dim=-1), K, dim=-1)
        return layer(x, ids, w) + x

    counters.clear()
    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for seed in range(4):  # cudagraph trees record on the second call, replay afterwards
            x = torch.randn(8, H, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
            torch.testing.assert_close(compiled(x), f(x), rtol=2e-2, atol=2e-2)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _cpu_pipelines():
    """Every pipeline this CPU builds for a bf16 layer: the reference's, the NPU backend's
    (emulated) and, under TRITON_INTERPRET=1, the portable Triton ones."""
    settings = moehal.Settings(emulate=frozenset({"npu"}))
    reg = moehal.Registry(settings)
    reg.load_entry_points()
    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER)
    req = moehal.BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), moehal.detect("cpu"), settings)
    pipes = {}
    for backend in (None, "rocm"):  # (interpreted pipelines only where their backend is asked for)
        pipes.update((p.name, p) for p in moehal.enumerate_pipelines(req, reg, backend)[0])
    return cfg, reg, pipes


@pytest.mark.parametrize("processed", [True, False], ids=["processed", "loaded-unprocessed"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_every_cpu_pipeline_copies_and_the_copy_runs_alone(processed, how):
    """A Triton layer failed to copy (a module among its runner's state), and copies shared the
    original's graph caches and stream order. A copy now runs on its own weights."""
    import copy
    import pickle

    cfg, reg, pipes = _cpu_pipelines()
    assert "reference.local -> reference.experts [standard[bfloat16]]" in pipes
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert "reference.local -> rocm.triton [standard[bfloat16]]" in pipes
    gen = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).bfloat16()
    x = torch.randn(3, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(3)])
    wts = torch.rand(3, K, generator=gen)
    dup = copy.deepcopy if how == "deepcopy" else (lambda m: pickle.loads(pickle.dumps(m)))
    for name, pipe in pipes.items():
        layer = moehal.MoELayer(cfg, device="cpu", registry=reg, pipeline=pipe)
        layer.load_weights(w13=w13.clone(), w2=w2.clone(), process=processed)
        twin = dup(layer)
        for lay in (layer, twin):
            if not processed:
                lay.process_weights_after_loading()
        assert twin._op_id != layer._op_id, name
        want = layer(x, ids, wts)
        assert torch.equal(twin(x, ids, wts), want), name
        del layer  # the copy holds nothing of the original
        gc.collect()
        assert torch.equal(twin(x, ids, wts), want), name


def test_a_layer_processed_on_a_gpu_refuses_to_copy(monkeypatch):
    """On an accelerator, bound launches hold the layer's buffer addresses: a copy would run on
    the original's buffers, so copying is refused (before load_weights it is a rebuild)."""
    import copy

    layer, *_ = _layer()
    monkeypatch.setattr(layer, "device", torch.device("cuda", 0))
    with pytest.raises(moehal.NotSupportedError, match="Copy the model before load_weights"):
        copy.deepcopy(layer)


@pytest.mark.parametrize("use_logits", [False, True], ids=["topk", "logits"])
def test_a_model_compiled_with_autograd_on_runs_as_eager_does(use_logits):
    """`model.eval()` without `torch.no_grad()`: the routers' parameters require grad, and the
    compilers that trace autograd failed on the op ("no autograd formula was registered"), while
    the eager forward runs without recording. The compiled model now runs as eager does."""
    model = TinyMoEModel(use_logits)
    x = torch.randn(5, H)
    with torch.no_grad():
        want = model(x)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)


def test_out_compiles_with_a_token_count_that_has_no_value():
    """`out=` under an unbacked token dimension (`mark_unbacked`, as data-dependent batch sizes
    give): `out.numel() > 1` and the shape comparison asked for guards no compiler can make."""
    layer, *_ = _layer()
    router = torch.nn.Linear(H, E)
    buf = torch.empty(64, H)

    def step(x):
        w, ids = torch.topk(torch.softmax(router(x), -1), K, -1)
        return x + layer(x, ids, w, out=buf[: x.shape[0]]) + layer(x, ids, w, out=torch.empty_like(x))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for t in (5, 9):
            x = torch.randn(t, H)
            torch._dynamo.decorators.mark_unbacked(x, 0)
            torch.testing.assert_close(compiled(x), step(x), rtol=1e-5, atol=1e-5)


def test_op_ids_carry_the_layers_fingerprint(monkeypatch):
    """Ids are the order of construction and a fingerprint of what the layer computes: a program
    exported in a process whose first layer had another config names no layer of the loading
    process's first one, and says what happened, rather than running it."""
    import itertools

    first, *_ = _layer()
    monkeypatch.setattr(custom_op, "_ids", itertools.count(1 << 30))  # another process (counts no layer has)
    same, *_ = _layer(seed=3)  # the same config built first: the same id, as compile caches want
    monkeypatch.setattr(custom_op, "_ids", itertools.count(1 << 30))
    other, *_ = _layer(dtype=torch.bfloat16)
    assert same._op_id >> 24 == other._op_id >> 24 == 1 << 30
    assert other._op_id != same._op_id
    with pytest.raises(moehal.MoEHalError, match="exported in a process that built other layers"):
        custom_op.get_layer(other._op_id ^ 1)
    del first
