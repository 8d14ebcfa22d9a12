"""moehal as a transformers experts implementation: tiny models of several MoE families, built
from configs in the test (no downloads), give the same logits with experts_implementation="moehal"
as with "eager"; every layout flag maps to moehal's canonical weights."""

from __future__ import annotations

import itertools
import logging

import moehal
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
mt = pytest.importorskip("moehal.integrations.transformers")
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, HID, INTER, E, K = 96, 64, 32, 8, 2
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _families():
    c = transformers
    return {
        "qwen3_moe": lambda: c.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=HID, intermediate_size=2 * INTER, moe_intermediate_size=INTER,
            num_hidden_layers=2, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, **ATTN,
        ),
        "mixtral": lambda: c.MixtralConfig(
            vocab_size=VOCAB, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=2,
            num_local_experts=E, num_experts_per_tok=K, **ATTN,
        ),
        "olmoe": lambda: c.OlmoeConfig(
            vocab_size=VOCAB, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=2,
            num_experts=E, num_experts_per_tok=K, **ATTN,
        ),
        "gpt_oss": lambda: c.GptOssConfig(
            vocab_size=VOCAB, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=2,
            num_local_experts=E, num_experts_per_tok=K, layer_types=["full_attention", "sliding_attention"],
            sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **ATTN,
        ),
        "deepseek_v3": lambda: c.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HID, intermediate_size=2 * INTER, moe_intermediate_size=INTER,
            num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=E, n_shared_experts=1,
            num_experts_per_tok=K, n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        ),
    }  # fmt: skip


def _randomize_experts(model, seed: int, bias_scale: float) -> int:
    """Give expert weights O(1) pre-activations (and biases) so that gating, interleaving and
    the SwiGLU clamps all matter; transformers' init would leave biases at zero."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for m in model.modules():
            if not (hasattr(m, "is_concatenated") and hasattr(m, "down_proj")):
                continue
            n += 1
            for name, p in m.named_parameters(recurse=False):
                if name.endswith("_bias"):
                    p.copy_(torch.randn(p.shape, generator=gen) * bias_scale)
                else:
                    fan_in = p.shape[1] if m.is_transposed else p.shape[2]
                    p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / fan_in**0.5)
    return n


def _model(family: str, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = _families()[family]()
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    assert _randomize_experts(model, seed=1, bias_scale=3.0) >= 1
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"])
def test_logits_match_eager(family):
    model = _model(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        model.set_experts_implementation("moehal")
        assert model.config._experts_implementation == "moehal"
        ours = model(ids).logits
    layers = [m.__dict__["_moehal_state"].layer for m in model.modules() if "_moehal_state" in m.__dict__]
    assert layers, "moehal was not called"
    if family == "gpt_oss":
        c = layers[0].config
        assert (c.activation, c.has_w13_bias, c.has_w2_bias) == (moehal.Activation.SWIGLU_OAI, True, True)
        experts = model.model.layers[0].mlp.experts
        assert (c.swiglu_alpha, c.swiglu_limit) == (float(experts.alpha), float(experts.limit))
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)


def _gpt_oss_float64(experts, x, ids, wts):
    """gpt-oss experts written out from the model card: [E, H, 2I] weights, gate/up interleaved."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    lim, alpha = float(experts.limit), float(experts.alpha)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].double() @ experts.gate_up_proj[e].double() + experts.gate_up_proj_bias[e].double()
            g, u = h[0::2].clamp(max=lim), h[1::2].clamp(-lim, lim)
            y = (u + 1) * g * torch.sigmoid(alpha * g)
            out[t] += float(wts[t, k]) * (y @ experts.down_proj[e].double() + experts.down_proj_bias[e].double())
    return out


def test_experts_implementation_kwarg_bf16_gpt_oss():
    cfg = _families()["gpt_oss"]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation="moehal")
    assert model.config._experts_implementation == "moehal"
    _randomize_experts(model, seed=3, bias_scale=3.0)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, HID, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(16)])
    wts = torch.softmax(torch.randn(16, K, generator=gen), -1).bfloat16()  # gpt-oss routes in the model dtype
    with torch.no_grad():
        ours = experts(x, ids, wts)  # dispatched by transformers to moehal
        eager = type(experts).forward.__wrapped__(experts, x, ids, wts)  # the model's own loop
    assert "_moehal_state" in experts.__dict__ and ours.dtype == torch.bfloat16
    truth = _gpt_oss_float64(experts, x, ids, wts)
    err_ours = (ours.double() - truth).abs().max()
    err_eager = (eager.double() - truth).abs().max()
    # bf16: both round; moehal must be no less accurate than transformers' own eager loop.
    assert err_ours <= 1.25 * err_eager + 1e-3 * truth.abs().max(), (err_ours, err_eager)
    torch.testing.assert_close(ours.double(), truth, rtol=2e-2, atol=2e-2 * truth.abs().max().item())


def test_weights_changed_in_place_rebuild_the_layer():
    model = _model("qwen3_moe")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    model.set_experts_implementation("moehal")
    with torch.no_grad():
        model(ids)
        experts = next(m for m in model.modules() if "_moehal_state" in m.__dict__)
        before = experts.__dict__["_moehal_state"].layer
        experts.down_proj.mul_(-1.5)  # in place: same storage, new version
        ours = model(ids).logits
        assert experts.__dict__["_moehal_state"].layer is not before
        model.set_experts_implementation("eager")
        torch.testing.assert_close(ours, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_inference_tensor_weights_warn_and_force_rebuilds_after_an_in_place_change():
    """Weights made under `torch.inference_mode()` keep no version counter, so moehal cannot
    see them change in place: it says so when it builds the layer, and `prepare(model,
    force=True)` rebuilds it after the change."""
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():  # an engine that builds and loads its model in inference mode
        model = _model("qwen3_moe")
        model.set_experts_implementation("moehal")
        with pytest.warns(mt.UntrackedWeightsWarning, match=r"prepare\(model, force=True\)"):
            model(ids)
        experts = next(m for m in model.modules() if "_moehal_state" in m.__dict__)
        assert experts.down_proj.is_inference()
        before = experts.__dict__["_moehal_state"].layer
        experts.down_proj.mul_(-1.5)  # in place, unseen: the same storage, no version
        model(ids)
        assert experts.__dict__["_moehal_state"].layer is before
        assert mt.prepare(model, force=True) >= 1
        assert experts.__dict__["_moehal_state"].layer is not before
        ours = model(ids).logits
        model.set_experts_implementation("eager")
        torch.testing.assert_close(ours, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_compiled_experts_see_replaced_weights():
    # the compiled forward skips the eager weight check: the custom op makes it, and the rebuilt
    # layer takes over the old one's op id, so the graph runs the new weights without a recompile
    model = _model("qwen3_moe")
    model.set_experts_implementation("moehal")
    mt.prepare(model)
    experts = next(m for m in model.modules() if "_moehal_state" in m.__dict__)
    gen = torch.Generator().manual_seed(11)
    x, wts = torch.randn(6, HID, generator=gen), torch.rand(6, K, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(6)])
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend="eager")
    with torch.no_grad():
        before = compiled(x, ids, wts)
        op_id = experts.__dict__["_moehal_state"].layer._op_id
        experts.down_proj = torch.nn.Parameter(-1.5 * experts.down_proj.detach())  # new storage
        after = compiled(x, ids, wts)
        assert experts.__dict__["_moehal_state"].layer._op_id == op_id  # rebuilt, same id
        torch.testing.assert_close(after, experts(x, ids, wts), rtol=0, atol=0)
        torch.testing.assert_close(after, -1.5 * before, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_a_copied_model_builds_its_own_layers():
    """`copy.deepcopy` (a reference model beside a policy), pickle and `torch.save` of a prepared
    model: the copy carried the original's layer, under the key of the original's weights and
    with a custom-op id that nothing refreshed, so a compiled copy ran stale weights after an
    in-place change. A copy now has no layer until it builds its own."""
    import copy
    import io

    model = _model("mixtral")
    model.set_experts_implementation("moehal")
    mt.prepare(model)
    gen = torch.Generator().manual_seed(13)
    x, wts = torch.randn(6, HID, generator=gen), torch.rand(6, K, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(6)])
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        experts = next(m for m in twin.modules() if mt._is_experts_module(m))
        assert experts.__dict__.get("_moehal_state") is None
        torch._dynamo.reset()
        with torch.no_grad(), pytest.raises(Exception, match="no moehal layer yet"):
            torch.compile(experts, fullgraph=True, backend="eager")(x, ids, wts)
        assert mt.prepare(twin) >= 1
        torch._dynamo.reset()
        compiled = torch.compile(experts, fullgraph=True, backend="eager")
        with torch.no_grad():
            compiled(x, ids, wts)
            experts.gate_up_proj.mul_(-2.0)  # in place: the compiled copy must see it
            got = compiled(x, ids, wts)
            twin.set_experts_implementation("eager")
            want = experts(x, ids, wts)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_training_mode_is_refused_and_eval_without_no_grad_warns():
    """moehal's experts have no backward: a model in training mode got no gradient in its
    experts, and on some backends none in its router either, silently. Training mode now raises;
    a forward in eval mode that records autograd runs without recording it, and says so."""
    model = _model("qwen3_moe")
    model.set_experts_implementation("moehal")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    model.train()
    with pytest.raises(moehal.NotSupportedError, match=r"training mode.*model\.eval\(\)"):
        model(ids)
    model.eval()
    with torch.no_grad():
        want = model(ids).logits
    with pytest.warns(moehal.InferenceOnlyWarning):
        got = model(ids).logits  # autograd on: the embeddings require grad
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)


def test_activation_probe_sees_clamps_above_ten():
    # DeepSeek-V4 and GLM clamp SwiGLU at 10: a probe that never crosses the clamp took it for
    # plain SiLU and dropped it silently
    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=HID, intermediate_size=INTER, dtype=torch.float32)
    gen = torch.Generator().manual_seed(12)
    w13, w2 = torch.randn(E, 2 * INTER, HID, generator=gen), torch.randn(E, HID, INTER, generator=gen)
    module = mt.experts_module(cfg, w13, w2)

    def clamped(gate_up: torch.Tensor, limit: float = 10.0) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    module._apply_gate = clamped
    with pytest.raises(moehal.NotSupportedError, match="matches none of moehal's activations"):
        mt.infer_activation(module, cfg)
    module._apply_gate = lambda gu: clamped(gu, limit=900.0)  # a clamp anywhere the probe reaches
    with pytest.raises(moehal.NotSupportedError):
        mt.infer_activation(module, cfg)
    module._apply_gate = lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1]
    assert mt.infer_activation(module, cfg).activation is moehal.Activation.SILU


@pytest.mark.parametrize("quant", ["fp8_tensor", "nvfp4"])
def test_static_activation_scale_schemes_are_refused(quant):
    # a float checkpoint has no activation scales: placeholders would clip real hidden states
    with pytest.raises(moehal.NotSupportedError, match="static activation scales"):
        mt.register("moehal-static", quant=quant)
    with pytest.raises(moehal.NotSupportedError, match="static activation scales"):
        mt.prepare(_model("mixtral"), quant=quant)


def test_compiled_moe_block_has_no_graph_break():
    model = _model("qwen3_moe")
    model.set_experts_implementation("moehal")
    assert mt.prepare(model) == 2
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, HID, generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
        got = got[0] if isinstance(got, tuple) else got
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- every layout flag, against transformers' own implementations and a float64 oracle ---------


def _oracle(cfg, x, ids, wts, w13, w2, b13, b2):
    h = torch.einsum("th,enh->ten", x.double(), w13.double())
    if b13 is not None:
        h = h + b13.double()[None]
    a = moehal.activations.apply_activation(h, cfg)
    y = torch.einsum("tei,ehi->teh", a, w2.double())
    if b2 is not None:
        y = y + b2.double()[None]
    sel = torch.zeros(x.shape[0], cfg.num_experts, dtype=torch.float64)
    sel.scatter_(1, ids.long(), wts.double())
    return torch.einsum("te,teh->th", sel, y)


LAYOUTS = [
    mt.ExpertsLayout(has_gate=g, is_concatenated=c, is_transposed=t, has_bias=b)
    for g, c, t, b in itertools.product([True, False], [True, False], [True, False], [True, False])
    if g or c  # interleaving only exists for gate/up pairs
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "-".join(f"{k}={int(v)}" for k, v in vars(lay).items()))
def test_layout_flags_map_to_canonical(layout):
    oai = layout.has_gate and layout.has_bias  # gpt-oss style, with non-default alpha and limit
    cfg = moehal.MoEConfig(
        num_experts=E, top_k=K, hidden_size=HID, intermediate_size=INTER, gated=layout.has_gate,
        activation=moehal.Activation.SWIGLU_OAI if oai else moehal.Activation.SILU,
        swiglu_alpha=1.5 if oai else 1.702, swiglu_limit=5.0 if oai else 7.0,
        has_w13_bias=layout.has_bias, has_w2_bias=layout.has_bias, dtype=torch.float32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    w13 = torch.randn(E, cfg.w13_rows, HID, generator=gen) * 2 / HID**0.5
    w2 = torch.randn(E, HID, INTER, generator=gen) / INTER**0.5
    b13 = torch.randn(E, cfg.w13_rows, generator=gen) * 2 if layout.has_bias else None
    b2 = torch.randn(E, HID, generator=gen) if layout.has_bias else None
    module = mt.experts_module(cfg, w13, w2, b13, b2, layout=layout)

    got = mt.canonical_weights(module)
    for want, have in zip((w13, w2, b13, b2), got):
        assert (want is None) == (have is None)
        if want is not None:
            torch.testing.assert_close(have, want, rtol=0, atol=0)

    x = torch.randn(10, HID, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(10)])
    wts = torch.rand(10, K, generator=gen)
    want = _oracle(cfg, x, ids, wts, w13, w2, b13, b2)
    ours = mt.moehal_experts_forward(module, x, ids, wts)
    assert module.__dict__["_moehal_state"].layer.config == cfg  # activation, alpha, limit inferred
    torch.testing.assert_close(ours.double(), want, rtol=1e-4, atol=1e-4)
    peers = mt.peer_implementations()
    assert {"grouped_mm", "batched_mm"} <= set(peers)
    for name, fn in peers.items():
        torch.testing.assert_close(fn(module, x, ids, wts).double(), want, rtol=1e-4, atol=1e-4, msg=name)
        if layout == mt.ExpertsLayout(has_gate=True) or layout == mt.ExpertsLayout(has_gate=False):
            call = mt.peer_callable(name, cfg, w13, w2, "cpu")  # what moehal bench times
            torch.testing.assert_close(call(x, ids.int(), wts).double(), want, rtol=1e-4, atol=1e-4, msg=name)


def test_unsupported_layouts_say_why():
    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=HID, intermediate_size=INTER, dtype=torch.float32)
    gen = torch.Generator().manual_seed(8)
    w13, w2 = torch.randn(E, 2 * INTER, HID, generator=gen), torch.randn(E, HID, INTER, generator=gen)
    x, ids, wts = torch.randn(3, HID), torch.zeros(3, K, dtype=torch.int64), torch.rand(3, K)
    ids[:, 1] = 1

    tanh_gelu = mt.experts_module(cfg, w13, w2)
    tanh_gelu._apply_gate = lambda gu: (
        torch.nn.functional.gelu(gu.chunk(2, -1)[0], approximate="tanh") * gu.chunk(2, -1)[1]
    )
    with pytest.raises(moehal.NotSupportedError, match="matches none of moehal's activations"):
        mt.moehal_experts_forward(tanh_gelu, x, ids, wts)

    normed = mt.experts_module(cfg, w13, w2)
    normed.has_post_expert_norm = True
    with pytest.raises(moehal.NotSupportedError, match="has_post_expert_norm"):
        mt.moehal_experts_forward(normed, x, ids, wts)


def test_registered_names():
    assert "moehal" in ALL_EXPERTS_FUNCTIONS
    assert mt.register("moehal-reference", backend="reference") == "moehal-reference"
    assert "moehal-reference" in ALL_EXPERTS_FUNCTIONS
    model = _model("mixtral")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        model.set_experts_implementation("moehal-reference")
        ours = model(ids).logits
        layer = next(m for m in model.modules() if "_moehal_state" in m.__dict__).__dict__["_moehal_state"].layer
        assert layer.plan.pipeline.experts.backend == "reference"
        model.set_experts_implementation("eager")
        torch.testing.assert_close(ours, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_two_threads_meeting_one_stale_layer_build_it_once(monkeypatch):
    """Two threads whose forwards met the same stale layer both rebuilt it, and the state stored
    last could name a custom-op id the other layer took over and released when it died. Builds
    are serialized now, and the second thread finds the first one's layer."""
    import threading
    import time

    model = _model("qwen3_moe")
    experts = next(m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "down_proj"))
    built, entered, proceed = [], threading.Event(), threading.Event()
    build = mt._build

    def slow_build(*args, **kwargs):
        built.append(threading.get_ident())
        entered.set()
        proceed.wait(timeout=5)
        return build(*args, **kwargs)

    monkeypatch.setattr(mt, "_build", slow_build)
    scheme = moehal.QuantScheme.parse("bf16")
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(mt._prepared(experts, K, "auto", scheme))) for _ in "ab"]
    threads[0].start()
    assert entered.wait(timeout=5)
    threads[1].start()
    time.sleep(0.3)  # the second thread waits for the first one's build, or (unserialized) starts its own
    proceed.set()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(got) == 2 and got[0] is got[1]
