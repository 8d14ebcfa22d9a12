"""Bad input raises typed, actionable errors."""

from __future__ import annotations

import moehal
import pytest
import torch
from moe_testing import build_problem

CFG = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
BF16 = moehal.QuantScheme.parse("bf16")


@pytest.fixture
def layer(registry):
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(CFG, BF16, registry=registry)
    layer.load_weights(weights)
    return layer


def _inputs(t=3):
    x = torch.randn(t, 32).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])[:t]
    return x, ids, torch.rand(t, 2)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, i, w: (x.float(), i, w), "dtype is torch.float32"),
        (lambda x, i, w: (x[:, :16], i, w), r"must be \[T, 32\]"),
        (lambda x, i, w: (x.to("meta"), i, w), "is on meta"),
        (lambda x, i, w: (x, i + 3, w), r"out of range: found \[3, 6\]"),
        (lambda x, i, w: (x, torch.tensor([[0, 0], [1, 2], [3, 1]]), w), "repeat an expert"),
        (lambda x, i, w: (x, i.float(), w), "int32 or int64"),
        (lambda x, i, w: (x, i[:, :1], w), r"must be \[3, 2\]"),
        (lambda x, i, w: (x, i, w * float("nan")), "NaN or Inf"),
        (lambda x, i, w: (x, i, w.int()), "floating point"),
    ],
)
def test_bad_forward_inputs(layer, mutate, match):
    with pytest.raises(moehal.InputError, match=match):
        layer(*mutate(*_inputs()))


def test_missing_routing_inputs(layer):
    x, ids, w = _inputs()
    with pytest.raises(moehal.InputError, match="pass topk_ids and topk_weights"):
        layer(x)
    with pytest.raises(moehal.InputError, match="MoEConfig.routing is None"):
        layer(x, router_logits=torch.randn(3, 4))


def test_weights_not_loaded(registry):
    layer = moehal.MoELayer(CFG, BF16, registry=registry)
    with pytest.raises(moehal.WeightsNotLoadedError, match="load_weights"):
        layer(*_inputs())
    with pytest.raises(moehal.WeightsNotLoadedError):
        layer.process_weights_after_loading()


def test_weight_processing_twice_is_refused(registry):
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(CFG, BF16, registry=registry)
    layer.load_weights(weights, process=False)
    layer.process_weights_after_loading()
    with pytest.raises(moehal.WeightsAlreadyProcessedError, match="twice"):
        layer.process_weights_after_loading()
    with pytest.raises(moehal.WeightsAlreadyProcessedError):
        layer.load_weights(weights)


@pytest.mark.parametrize(
    "quant, change, match",
    [
        (
            "bf16",
            dict(w13=torch.zeros(4, 16, 32, dtype=torch.bfloat16)),
            r"shape \[4, 16, 32\], expected \[4, 32, 32\]",
        ),
        ("bf16", dict(w2=torch.zeros(4, 32, 16)), "dtype torch.float32"),
        ("fp8_block", dict(w13_scale=None), "need `w13_scale`"),
        ("bf16", dict(w13_scale=torch.ones(4)), "unexpected tensors"),
    ],
)
def test_malformed_weights(registry, quant, change, match):
    q = moehal.QuantScheme.parse(quant)
    weights, *_ = build_problem(CFG, q, 1)
    layer = moehal.MoELayer(CFG, q, registry=registry)
    with pytest.raises(moehal.WeightError, match=match):
        layer.load_weights(weights.replace(**change))


def test_ep_weights_hint(registry):
    cfg = CFG.with_(ep_size=2, ep_rank=0)
    weights, *_ = build_problem(CFG, BF16, 1)  # all 4 experts, but the rank owns 2
    with pytest.raises(moehal.WeightError, match="local experts"):
        moehal.MoELayer(cfg, BF16, registry=registry).load_weights(weights)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=5), "exceeds num_experts"),
        (dict(ep_size=3), "not divisible by ep_size"),
        (dict(ep_size=2, ep_rank=2), "outside"),
        (dict(activation="swiglu_oai", gated=False), "gated by definition"),
        (dict(apply_router_weight_on_input=True), "top_k == 1"),
        (dict(dtype=torch.int8), "bf16, fp16, fp32"),
        (dict(hidden_size=0), "must be positive"),
        (dict(routing=moehal.RoutingConfig("deepseek_v3", n_group=3)), "not divisible by n_group"),
    ],
)
def test_config_errors(kwargs, match):
    base = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    with pytest.raises(moehal.ConfigError, match=match):
        moehal.MoEConfig(**{**base, **kwargs})


def test_cuda_graph_replay_is_refused_off_cuda(layer):
    with pytest.raises(moehal.NotSupportedError, match="needs a CUDA device"):
        layer.cuda_graph_tokens = 64
    with pytest.raises(moehal.InputError, match=">= 0"):
        layer.cuda_graph_tokens = -1
    assert layer.cuda_graph_tokens == 0
    x, ids, w = _inputs()
    assert torch.equal(layer(x, ids, w), layer(x, ids, w))  # still the plain eager path


class _FakeGraph:
    """Stands in for a CUDA graph on CPU: replay re-runs the function on the tensors it was
    captured on and writes the captured output in place, as a graph does."""

    def __init__(self, fn, tensors, output):
        self.fn, self.tensors, self.output = fn, tensors, output

    def replay(self):
        self.output.copy_(self.fn(*self.tensors))


def _fake_graph_cache(fn):
    from moehal import graphs

    cache = graphs.GraphCache(fn, torch.device("cpu"))

    def capture(inputs, copy_inputs, out=None):
        tensors = tuple(t.clone() for t in inputs) if copy_inputs else inputs
        result = fn(*tensors) if out is None else out.copy_(fn(*tensors))
        return graphs._Captured(_FakeGraph(fn, tensors, result), tensors if copy_inputs else (), result)

    cache._capture = capture  # type: ignore[method-assign]
    return cache


def test_graph_cache_replays_with_new_inputs_on_cpu_semantics():
    """The cache's bookkeeping (one capture per token count, inputs copied in, output copied
    out) without a GPU: a stand-in graph object that records and re-runs the function."""
    from moehal import graphs

    cache = _fake_graph_cache(lambda x, y: x * 2 + y)
    a = cache(torch.ones(3), torch.zeros(3))
    b = cache(torch.full((3,), 5.0), torch.ones(3))
    c = cache(torch.ones(2), torch.ones(2))
    d = cache(torch.ones(2, dtype=torch.float64), torch.ones(2))  # another dtype: another graph
    assert d.dtype == torch.float64 and len(cache._graphs) == 3
    assert a.tolist() == [2.0] * 3, "an earlier output must not change when the graph replays again"
    assert b.tolist() == [11.0] * 3 and c.tolist() == [3.0] * 2
    assert cache.captured_token_counts == [2, 3]
    assert not graphs.should_replay(64, torch.ones(3, 4))  # CPU tensors never replay


def test_graph_cache_reads_inputs_in_place_when_the_caller_reuses_its_tensors():
    """A caller that passes the same tensors again gets a graph captured on them (no copy in);
    it reads what they hold at each call, and other tensors still take the copying graph."""
    from moehal import graphs

    cache = _fake_graph_cache(lambda x, y: x * 2 + y)
    x, y = torch.ones(3), torch.zeros(3)
    first = cache(x, y)  # new addresses: the copying graph
    assert cache.direct_graphs == 0
    second = cache(x, y)  # the same addresses twice in a row: captured on x and y themselves
    assert cache.direct_graphs == 1
    x.fill_(5.0)  # the caller refills its buffer in place
    third = cache(x, y)
    assert third.tolist() == [10.0] * 3 and cache.direct_graphs == 1
    static = cache._graphs[cache.key((x, y))].inputs[0]
    assert static.tolist() == [1.0] * 3, "a direct replay must not copy into the copying graph's inputs"
    other = cache(torch.full((3,), 2.0), torch.ones(3))  # other tensors: copied in
    assert other.tolist() == [5.0] * 3
    assert first.tolist() == second.tolist() == [2.0] * 3, "outputs stay the caller's"
    assert cache._direct[cache.where((x, y))].inputs == (), "no reference kept"
    y_t = torch.zeros(3, 2)[:, 0]  # same shape, other strides: never the direct graph of y
    assert cache.where((x, y_t)) != cache.where((x, y))
    for _ in range(3 * graphs.DIRECT_PER_TOKEN_COUNT):  # at most this many direct graphs per count
        u, v = torch.rand(3), torch.rand(3)
        assert torch.allclose(cache(u, v), u * 2 + v) and torch.allclose(cache(u, v), u * 2 + v)
    assert cache.direct_graphs == graphs.DIRECT_PER_TOKEN_COUNT
    cache.clear()
    assert cache.direct_graphs == 0 and cache.captured_token_counts == []


def test_graph_cache_writes_into_the_callers_output_buffer():
    """`out=`: a direct graph captured with the caller's output buffer writes the result there
    (the call returns that very tensor, nothing cloned); other calls copy into it."""
    cache = _fake_graph_cache(lambda x, y: x * 2 + y)
    x, y, out = torch.ones(3), torch.zeros(3), torch.empty(3)
    assert cache(x, y, out=out) is out and out.tolist() == [2.0] * 3  # copying graph, copied out
    assert cache(x, y, out=out) is out and cache.direct_graphs == 1  # captured on x, y and out
    x.fill_(4.0)
    assert cache(x, y, out=out) is out and out.tolist() == [8.0] * 3
    cap = next(iter(cache._direct.values()))
    assert cap.output is out, "the direct graph's output is the caller's buffer"
    other = torch.empty(3)  # another output buffer: not the direct graph's
    assert cache(x, y, out=other) is other and other.tolist() == [8.0] * 3
    plain = cache(x, y)  # no out: a fresh tensor, as before
    assert plain is not out and plain.tolist() == [8.0] * 3


def test_forward_writes_into_out(layer):
    x, ids, w = _inputs()
    out = torch.empty_like(x)
    y = layer(x, ids, w, out=out)
    assert y is out and torch.equal(out, layer(x, ids, w))
    with pytest.raises(moehal.InputError, match="out must be"):
        layer(x, ids, w, out=torch.empty(3, 32))  # float32, not the layer's bf16
    with pytest.raises(moehal.InputError, match="out must be"):
        layer(x, ids, w, out=torch.empty(2, 32, dtype=torch.bfloat16))


def test_replay_direct_serves_only_the_exact_tensors_it_was_captured_on():
    """`replay_direct` is the forward's first step, before the input checks, so it must miss for
    anything the checks would look at: another shape at the same address, other strides,
    another dtype, another output buffer, or a non-tensor."""
    cache = _fake_graph_cache(lambda x, y: x * 2 + y)
    x, y, out = torch.ones(4, 6), torch.zeros(4, 6), torch.empty(4, 6)
    assert cache.replay_direct((x, y), out) is None, "nothing captured yet"
    cache(x, y, out=out)
    cache(x, y, out=out)  # the same addresses twice: the direct graph
    x.fill_(3.0)
    assert cache.replay_direct((x, y), out) is out and out.tolist() == [[6.0] * 6] * 4
    assert cache.replay_direct((x[:, :4], y[:, :4]), out[:, :4]) is None, "a narrower view at the same address"
    assert cache.replay_direct((x[:2], y[:2]), out[:2]) is None, "fewer tokens at the same address"
    assert cache.replay_direct((x, y.t().contiguous().t()), out) is None, "other strides"
    assert cache.replay_direct((x, y), torch.empty(4, 6)) is None, "another output buffer"
    assert cache.replay_direct((x, y), None) is None, "no direct graph for calls without out= yet"
    assert cache.replay_direct((x, None), out) is None and cache.replay_direct((x, 3), out) is None
    assert cache.captured_token_counts == [4]


def test_forward_replays_a_direct_graph_before_its_checks_and_checks_everything_else(layer):
    """The layer's steady state (same buffers, `out=`) is one replay; a call that differs in any
    checked way still gets the checks and their errors."""
    x, ids, w = _inputs()
    out = torch.empty_like(x)
    cache = _fake_graph_cache(layer._forward_topk)
    replays = []
    layer._graphs_topk = cache
    layer._graph_tokens, layer.validate_values = 64, False  # as on CUDA (the CPU layer refuses graphs)
    cache(x, ids, w, out=out)
    cache(x, ids, w, out=out)  # captured on the caller's tensors
    cap = next(iter(cache._direct.values()))
    inner = cap.graph.replay
    cap.graph.replay = lambda: (replays.append(1), inner())[1]
    expect = layer._forward_topk(x, ids, w)
    assert layer(x, ids, w, out=out) is out and replays == [1] and torch.equal(out, expect)
    with pytest.raises(moehal.InputError, match="hidden_states must be"):
        layer(x[:, :16], ids, w, out=out[:, :16])  # same address, narrower: not the graph
    with pytest.raises(moehal.InputError, match="either topk_ids"):
        layer(x, ids, w, router_logits=torch.zeros(x.shape[0], 8), out=out)
    layer.validate_values = True  # values are checked on every call, so never the unchecked replay
    bad = ids.clone()
    ids.fill_(99)
    with pytest.raises(moehal.InputError, match="out of range"):
        layer(x, ids, w, out=out)
    ids.copy_(bad)
    assert replays == [1]
