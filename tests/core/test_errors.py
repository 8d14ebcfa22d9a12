"""Bad input raises typed, actionable errors. The layers are built on the CPU, where these
tests' weights and inputs are, whatever the machine has (on a GPU the best device would be
chosen, and every test would meet the device check instead)."""

from __future__ import annotations

import re

import moehal
import pytest
import torch
from moe_testing import build_problem
from moehal.graphs import GraphCache

CFG = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
BF16 = moehal.QuantScheme.parse("bf16")


@pytest.fixture
def layer(registry):
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
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
        (lambda x, i, w: (x, torch.tensor([[-1, 0], [1, 2], [3, 1]]), w), "build with topk_padding=True"),
        (lambda x, i, w: (x, i.float(), w), "int32 or int64"),
        (lambda x, i, w: (x, i[:, :1], w), r"must be \[3, 2\]"),
        (lambda x, i, w: (x, i, w * float("nan")), "NaN or Inf"),
        (lambda x, i, w: (x, i, w.int()), "floating point"),
    ],
)
def test_bad_forward_inputs(layer, mutate, match):
    with pytest.raises(moehal.InputError, match=match):
        layer(*mutate(*_inputs()))


def test_padding_ids_are_checked_as_padding(registry):
    """With `topk_padding`, -1 marks a dropped slot (any number per token); other negative ids
    and repeated experts are still refused."""
    cfg = CFG.with_(topk_padding=True)
    weights, *_ = build_problem(cfg, BF16, 1)
    layer = moehal.MoELayer(cfg, BF16, device="cpu", registry=registry)
    layer.load_weights(weights)
    x, _, w = _inputs()
    out = layer(x, torch.tensor([[-1, -1], [2, -1], [1, 2]]), w)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    with pytest.raises(moehal.InputError, match=r"found \[-2, 2\], allowed \[-1, 4\)"):
        layer(x, torch.tensor([[-2, 0], [2, 1], [1, 2]]), w)
    with pytest.raises(moehal.InputError, match="repeat an expert"):
        layer(x, torch.tensor([[-1, -1], [2, 2], [1, 0]]), w)


def test_missing_routing_inputs(layer):
    x, ids, w = _inputs()
    with pytest.raises(moehal.InputError, match="pass topk_ids and topk_weights"):
        layer(x)
    with pytest.raises(moehal.InputError, match="MoEConfig.routing is None"):
        layer(x, router_logits=torch.randn(3, 4))


def test_weights_not_loaded(registry):
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
    with pytest.raises(moehal.WeightsNotLoadedError, match="load_weights"):
        layer(*_inputs())
    with pytest.raises(moehal.WeightsNotLoadedError):
        layer.process_weights_after_loading()


def test_weight_processing_twice_is_refused(registry):
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
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
    layer = moehal.MoELayer(CFG, q, device="cpu", registry=registry)
    with pytest.raises(moehal.WeightError, match=match):
        layer.load_weights(weights.replace(**change))


def test_ep_weights_hint(registry):
    cfg = CFG.with_(ep_size=2, ep_rank=0)
    weights, *_ = build_problem(CFG, BF16, 1)  # all 4 experts, but the rank owns 2
    with pytest.raises(moehal.WeightError, match="local experts"):
        moehal.MoELayer(cfg, BF16, device="cpu", registry=registry).load_weights(weights)


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
        (dict(routing=moehal.RoutingConfig("deepseek_v3", n_group=0)), "n_group must be a positive integer"),
        (dict(hidden_size=31.5), "hidden_size must be an integer, got 31.5"),  # not truncated to 31
        (dict(num_experts=4.0), "num_experts must be an integer"),
        (dict(ep_size=2, ep_rank=0.5), "ep_rank must be an integer"),
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(top_k=True), "top_k must be an integer"),
        (dict(activation="relu"), "activation must be one of silu, .*got 'relu'"),
        # a clamp <= 0 made every output constant, a NaN one every output NaN, silently
        (dict(activation="swiglu_oai", swiglu_limit=-7.0), "swiglu_limit must be > 0"),
        (dict(activation="swiglu_oai", swiglu_limit=0.0), "swiglu_limit must be > 0"),
        (dict(activation="swiglu_oai", swiglu_limit=float("nan")), "swiglu_limit must be > 0"),
        (dict(activation="swiglu_oai", swiglu_alpha=float("nan")), "swiglu_alpha must be finite"),
        (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be finite"),
    ],
)
def test_config_errors(kwargs, match):
    base = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    with pytest.raises(moehal.ConfigError, match=match):
        moehal.MoEConfig(**{**base, **kwargs})


def test_config_takes_numpy_and_torch_integers_as_python_ints():
    import numpy as np

    cfg = moehal.MoEConfig(num_experts=np.int64(4), top_k=2, hidden_size=torch.tensor(32).item(), intermediate_size=16)
    assert type(cfg.num_experts) is int and cfg.num_experts == 4 and cfg.hidden_size == 32


def test_cuda_graph_replay_is_refused_off_cuda(layer):
    with pytest.raises(moehal.NotSupportedError, match="needs a CUDA device"):
        layer.cuda_graph_tokens = 64
    with pytest.raises(moehal.InputError, match=">= 0"):
        layer.cuda_graph_tokens = -1
    assert layer.cuda_graph_tokens == 0
    x, ids, w = _inputs()
    assert torch.equal(layer(x, ids, w), layer(x, ids, w))  # still the plain eager path


def test_forward_writes_into_out(layer):
    x, ids, w = _inputs()
    out = torch.empty_like(x)
    y = layer(x, ids, w, out=out)
    assert y is out and torch.equal(out, layer(x, ids, w))
    with pytest.raises(moehal.InputError, match="out must be"):
        layer(x, ids, w, out=torch.empty(3, 32))  # float32, not the layer's bf16
    with pytest.raises(moehal.InputError, match="out must be"):
        layer(x, ids, w, out=torch.empty(2, 32, dtype=torch.bfloat16))


def test_forward_into_out_in_place_and_into_a_strided_view(layer):
    """`out=hidden_states` must not be written before the pipeline read its input, and an
    `out` whose rows are not contiguous is written too: both take the copying path."""
    x, ids, w = _inputs()
    want = layer(x, ids, w)
    inplace = x.clone()
    assert layer(inplace, ids, w, out=inplace) is inplace and torch.equal(inplace, want)
    wide = torch.full((3, 64), float("nan"), dtype=torch.bfloat16)
    view = wide[:, :32]
    assert layer(x, ids, w, out=view) is view and torch.equal(view, want)
    assert wide[:, 32:].isnan().all()


def test_experts_get_out_only_behind_a_dispatcher_that_keeps_tokens_in_place(layer, monkeypatch):
    """`ExpertsRunner.apply_into` may write the layer's result into `out`, which is right only
    when the experts' rows are the layer's tokens: a dispatcher that moves tokens between
    ranks (`tokens_in_place` False) never hands it over, nor does an in-place call."""
    given = []
    experts = layer._experts

    def apply_into(inp, out):
        given.append(out)
        return experts.apply(inp)

    monkeypatch.setattr(experts, "apply_into", apply_into)
    x, ids, w = _inputs()
    out = torch.empty_like(x)
    assert layer._dispatch.tokens_in_place  # reference.local: one device
    assert layer(x, ids, w, out=out) is out and len(given) == 1 and given[0] is out
    inplace = x.clone()
    layer(inplace, ids, w, out=inplace)
    monkeypatch.setattr(type(layer._dispatch), "tokens_in_place", False)
    assert layer(x, ids, w, out=out) is out and torch.equal(out, layer(x, ids, w))
    assert len(given) == 1


def test_forward_replays_a_direct_graph_before_its_checks_and_checks_everything_else(layer, fake_cuda_graphs):
    """The layer's steady state (same buffers, `out=`) is one replay; a call that differs in any
    checked way still gets the checks and their errors."""
    x, ids, w = _inputs()
    out = torch.empty_like(x)
    cache = GraphCache(layer._forward_topk, torch.device("cpu"))
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


def test_logits_and_top_k_weights_together_are_refused_even_where_a_direct_graph_exists(registry, fake_cuda_graphs):
    """The direct replay of a logits layer is keyed by the hidden states and logits only, so
    it must not serve a call that also passes top-k weights: that is the checked path's error,
    whether or not a graph was captured on those tensors."""
    cfg = CFG.with_(routing=moehal.RoutingConfig("softmax"))
    weights, *_ = build_problem(cfg, BF16, 1)
    layer = moehal.MoELayer(cfg, BF16, device="cpu", registry=registry)
    layer.load_weights(weights)
    layer._graphs_logits = cache = GraphCache(layer._forward_logits, torch.device("cpu"))
    layer._graph_tokens, layer.validate_values = 64, False  # as on CUDA (the CPU layer refuses graphs)
    x, logits = torch.randn(3, 32).bfloat16(), torch.randn(3, 4)
    out = torch.empty_like(x)
    cache(x, logits, out=out)
    cache(x, logits, out=out)  # captured on the caller's tensors
    assert cache.direct_graphs == 1
    assert layer(x, router_logits=logits, out=out) is out
    with pytest.raises(moehal.InputError, match="not both"):
        layer(x, None, torch.rand(3, 2), router_logits=logits, out=out)


def test_swiglu_without_a_clamp_is_allowed():
    cfg = moehal.MoEConfig(4, 2, 32, 16, activation="swiglu_oai", swiglu_limit=float("inf"))
    assert cfg.swiglu_limit == float("inf")


@pytest.mark.parametrize("value", ["lots", "nan", "-1"])
def test_masked_workspace_setting_errors_are_config_errors(value):
    """A bad MOEHAL_MASKED_WORKSPACE_GIB raised a bare ValueError out of every discover() (so of
    every CLI command and layer), and NaN or a negative budget passed."""
    with pytest.raises(moehal.ConfigError, match="MOEHAL_MASKED_WORKSPACE_GIB must be a number of GiB >= 0"):
        moehal.Settings.from_env({"MOEHAL_MASKED_WORKSPACE_GIB": value})
    with pytest.raises(moehal.ConfigError, match="masked_workspace_gib must be a number >= 0"):
        moehal.Settings(masked_workspace_gib=-1.0)


# Session 43's audit: errors that were untyped or misleading, and arguments taken unchecked.


def test_an_unknown_routing_method_is_a_config_error():
    with pytest.raises(moehal.ConfigError, match="method must be one of softmax, sigmoid, deepseek_v3; got 'topk'"):
        moehal.RoutingConfig("topk")


def test_an_unknown_quant_kind_or_scale_format_is_a_config_error():
    """Built directly (not through QuantScheme.parse), a bad name raised a bare ValueError."""
    with pytest.raises(moehal.ConfigError, match="kind must be one of bf16, .*got 'fp8_block:ue8m0'.*parse"):
        moehal.QuantScheme("fp8_block:ue8m0")
    with pytest.raises(moehal.ConfigError, match="scale_format must be one of float, ue8m0; got 'e8m0'"):
        moehal.QuantScheme("fp8_block", "e8m0")


def test_quantize_weights_takes_a_scheme_name_and_names_what_nvfp4_cannot_pack():
    w13, w2 = torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    w = moehal.quantize_weights(CFG, "fp8_block", w13, w2)  # as the README writes it
    assert w.w13.dtype == torch.float8_e4m3fn
    cfg = CFG.with_(intermediate_size=24)
    with pytest.raises(moehal.WeightError, match="multiples of 16"):
        moehal.quantize_weights(cfg, "nvfp4", torch.randn(4, 48, 32), torch.randn(4, 32, 24))


@pytest.mark.parametrize("value", [None, "64", 1.5, True])
def test_cuda_graph_tokens_must_be_an_int(layer, value):
    with pytest.raises(moehal.InputError, match="cuda_graph_tokens must be an int"):
        layer.cuda_graph_tokens = value
    import numpy as np

    layer.cuda_graph_tokens = np.int64(0)  # numpy and torch integers are ints, as in MoEConfig
    assert type(layer.cuda_graph_tokens) is int


def test_load_weights_names_a_dict_given_for_an_expert_weights(registry):
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
    with pytest.raises(moehal.WeightError, match=r"got dict \(a dict: load_weights\(\*\*weights\)\)"):
        layer.load_weights(weights.tensors())
    layer.load_weights(**weights.tensors())  # the way it says


def test_an_expanded_out_is_refused(layer):
    x, ids, w = _inputs()
    with pytest.raises(moehal.InputError, match="expanded view"):
        layer(x, ids, w, out=torch.zeros(1, 32, dtype=torch.bfloat16).expand(3, 32))


def test_a_forward_before_processing_says_to_process(registry):
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
    layer.load_weights(weights, process=False)
    with pytest.raises(moehal.WeightsNotLoadedError, match=r"call layer.process_weights_after_loading\(\)"):
        layer(*_inputs())


def test_a_pipeline_enumerated_for_another_request_is_refused():
    """`pipeline=` skipped every check: a pipeline enumerated for bf16 built for nvfp4 (then a
    bare KeyError at load). Now it must be accepted for the layer's own request."""
    settings = moehal.Settings(emulate=frozenset({"npu"}))
    reg = moehal.Registry(settings)
    reg.load_entry_points()
    req = moehal.BuildRequest(CFG, BF16, moehal.detect("cpu"), settings)
    pipe = next(p for p in moehal.enumerate_pipelines(req, reg)[0] if p.main.qualname == "npu.gmm")
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=reg, pipeline=pipe)  # its own request
    assert layer.plan.pipeline.name == pipe.name
    with pytest.raises(moehal.ConfigError, match=f"pipeline {re.escape(pipe.name)} is not accepted.*npu.gmm: "):
        moehal.MoELayer(CFG, "nvfp4", device="cpu", registry=reg, pipeline=pipe)


def test_a_forward_recording_autograd_warns_once_and_no_backend_gives_gradients(registry):
    """moehal's kernels have no backward. Called with inputs that require grad, the reference
    built a graph into the caller's weights while the Triton backends gave none, and the router
    got a gradient on some backends only, silently. Every backend now runs without recording,
    and the first such call says why."""
    weights, *_ = build_problem(CFG, BF16, 1)
    weights.w13.requires_grad_(True)  # an engine's nn.Parameter, handed to load_weights
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
    layer.load_weights(weights)
    x, ids, w = _inputs()
    with torch.no_grad():
        want = layer(x, ids, w)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with pytest.warns(moehal.InferenceOnlyWarning, match="torch.no_grad") as rec:
        y = layer(x, ids, w)
    assert rec[0].filename == __file__, "the warning names the caller's line"
    assert not y.requires_grad and torch.equal(y, want)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        assert torch.equal(layer(x, ids, w), want)


def test_conversions_that_would_move_or_recast_the_layer_raise(layer):
    """`.to()`, `.half()`, `.cuda()`: the kernels and the processed weights belong to one device
    and dtype. These conversions did nothing, and the forward failed later, or not at all
    where the caller kept the layer's dtype."""
    converts = (lambda m: m.half(), lambda m: m.float(), lambda m: m.to("meta"), lambda m: m.to_empty(device="meta"))
    for convert in converts:
        with pytest.raises(moehal.NotSupportedError, match="cannot be converted from cpu torch.bfloat16"):
            convert(layer)
    block = torch.nn.Sequential(torch.nn.Linear(32, 32, dtype=torch.bfloat16), layer)
    assert block.to("cpu") is block and block.bfloat16() is block  # no change: allowed
    x, ids, w = _inputs()
    with torch.no_grad():
        assert torch.equal(layer(x, ids, w), layer(x, ids, w))


def test_a_layer_on_the_meta_device_says_to_build_it_where_it_runs(registry):
    with pytest.raises(moehal.NotSupportedError, match="Build it on that device"):
        moehal.MoELayer(CFG, BF16, device="meta", registry=registry)


def test_a_missing_correction_bias_names_the_routing_that_needs_it(registry):
    routing = moehal.RoutingConfig("deepseek_v3", n_group=2, topk_group=1, has_correction_bias=True)
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16, routing=routing)
    weights, *_ = build_problem(CFG, BF16, 1)
    layer = moehal.MoELayer(cfg, BF16, device="cpu", registry=registry)
    with pytest.raises(moehal.WeightError, match=r"RoutingConfig\(has_correction_bias=True\) needs `correction_bias`"):
        layer.load_weights(w13=weights.w13, w2=weights.w2)


def test_a_layer_says_which_call_forms_it_serves(layer, registry):
    assert layer.accepts_topk and not layer.accepts_router_logits
    routed = moehal.MoELayer(CFG.with_(routing=moehal.RoutingConfig("softmax")), BF16, device="cpu", registry=registry)
    assert routed.accepts_topk and routed.accepts_router_logits
    routed._accepts_topk = False  # what a fused forward that routes in its kernel declares
    assert not routed.accepts_topk


def test_wrong_kinds_of_arguments_are_config_errors_naming_the_argument(registry):
    """Before: a dict config was blamed on whichever plugin's check met it first, a str routing
    and a dict registry raised AttributeError, 'gpu'/'npu' devices raised torch's RuntimeError."""
    for kwargs, match in (
        (dict(config=dict(num_experts=4)), "takes a moehal.MoEConfig, got dict"),
        (dict(registry={}), "registry must be a moehal Registry"),
        (dict(device="gpu"), "'gpu' is not a torch device"),
        (dict(device="npu"), "import torch_npu"),
    ):
        args = {"config": CFG, "registry": registry, **kwargs}
        with pytest.raises(moehal.ConfigError, match=match):
            moehal.MoELayer(args.pop("config"), **args)
    with pytest.raises(moehal.ConfigError, match=r"RoutingConfig\('softmax'\)"):
        moehal.MoEConfig(4, 2, 32, 16, routing="softmax")


def test_inputs_that_are_no_tensors_are_input_errors_with_autograd_on(layer):
    x, ids, w = _inputs()
    assert torch.is_grad_enabled()
    for args, match in (
        ((x.tolist(), ids, w), "hidden_states must be"),
        ((x, ids.tolist(), w), "topk_ids must be a torch.Tensor"),
        ((x, ids, w.tolist()), "topk_weights must be a torch.Tensor"),
    ):
        with pytest.raises(moehal.InputError, match=match):
            layer(*args)


def test_warnings_point_at_the_users_line_and_share_a_filterable_class(layer, monkeypatch):
    """A fixed stacklevel pointed into torch's call wrappers behind a forward hook, and into
    moehal for the settings warning: the first frame outside moehal and torch.nn is named."""
    import warnings

    x, ids, w = _inputs()
    layer.register_forward_hook(lambda *a: None)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        layer(x.requires_grad_(), ids, w)  # the line the warning names
    (inference,) = [g for g in got if issubclass(g.category, moehal.InferenceOnlyWarning)]
    assert inference.filename == __file__ and issubclass(inference.category, moehal.MoEHalWarning)
    monkeypatch.setenv("MOEHAL_DISABLE_PLUGINS", "cdua")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        moehal.discover(settings=moehal.Settings.from_env())
    (typo,) = [g for g in got if issubclass(g.category, moehal.SettingsWarning)]
    assert typo.filename == __file__ and "cdua" in str(typo.message)


def test_load_weights_names_misspelt_missing_and_non_tensor_fields(registry):
    layer = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
    w13, w2 = torch.zeros(4, 32, 32).bfloat16(), torch.zeros(4, 32, 16).bfloat16()
    with pytest.raises(moehal.WeightError, match="'w13_scales'; the fields are w13, w2, w13_scale"):
        layer.load_weights(w13=w13, w2=w2, w13_scales=w13)
    with pytest.raises(moehal.WeightError, match="missing 1 required .* 'w2'"):
        layer.load_weights(w13=w13)
    with pytest.raises(moehal.WeightError, match="`w2` must be a torch.Tensor, got list"):
        layer.load_weights(w13=w13, w2=[0.0])


def test_a_named_layer_is_named_in_what_it_raises(registry):
    """A 61-layer model's log said `InputError: hidden_states dtype is torch.float32` with no
    word of which layer raised it. A layer built with `name=` adds it as a note (its type and
    message stay as they were, for callers that match them) to what its forward and its weight
    loading raise, and shows it in `repr`; copies keep it."""
    import copy

    weights, *_ = build_problem(CFG, BF16, 1)
    named = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry, name="model.layers.3.mlp.experts")
    assert repr(named).startswith("MoELayer(name='model.layers.3.mlp.experts', ")
    with pytest.raises(moehal.WeightsNotLoadedError) as info:
        named(*_inputs())
    note = "(in moehal layer 'model.layers.3.mlp.experts')"
    if not hasattr(info.value, "add_note"):
        pytest.skip("exception notes need Python 3.11+")
    assert info.value.__notes__ == [note]
    with pytest.raises(moehal.WeightError, match="load_weights takes an ExpertWeights") as info:
        named.load_weights({"w13": weights.w13})
    assert info.value.__notes__ == [note]
    named.load_weights(weights)
    x, ids, w = _inputs()
    with pytest.raises(moehal.InputError, match="dtype is torch.float32") as info:
        named(x.float(), ids, w)
    assert info.value.__notes__ == [note]  # once, whatever the depth it was raised at
    with pytest.raises(moehal.WeightsAlreadyProcessedError) as info:
        named.process_weights_after_loading()
    assert info.value.__notes__ == [note]
    assert copy.deepcopy(named).layer_name == "model.layers.3.mlp.experts"
    unnamed = moehal.MoELayer(CFG, BF16, device="cpu", registry=registry)
    with pytest.raises(moehal.WeightsNotLoadedError) as info:
        unnamed(*_inputs())
    assert not getattr(info.value, "__notes__", None) and "name=" not in repr(unnamed)
    with pytest.raises(moehal.ConfigError, match="name must be a str or None, got int"):
        moehal.MoELayer(CFG, BF16, device="cpu", registry=registry, name=3)
