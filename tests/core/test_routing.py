"""Reference routing, and layers called with router logits."""

from __future__ import annotations

import moehal
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_testing import build_problem
from moehal.routing import RoutingConfig, route


def _deepseek_loop(logits, bias, k, n_group, topk_group, renorm):
    """Token-by-token DeepSeek-V3 selection written out with Python lists."""
    ids_out, w_out = [], []
    e = logits.shape[1]
    per = e // n_group
    for row, b in zip(torch.sigmoid(logits.double()), [bias.double()] * len(logits)):
        choice = (row + b).tolist()
        groups = [sorted(choice[g * per : (g + 1) * per], reverse=True) for g in range(n_group)]
        gscore = [sum(gs[:2]) for gs in groups]
        keep = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        cands = [j for j in range(e) if j // per in keep]
        ids = sorted(cands, key=lambda j: -choice[j])[:k]
        w = [row[j].item() for j in ids]
        if renorm:
            s = sum(w)
            w = [v / s for v in w]
        ids_out.append(ids)
        w_out.append(w)
    return torch.tensor(ids_out), torch.tensor(w_out)


@given(seed=st.integers(0, 2**16), t=st.integers(1, 6), renorm=st.booleans())
@settings(max_examples=30, deadline=None)
def test_deepseek_v3_grouped_routing(seed, t, renorm):
    g = torch.Generator().manual_seed(seed)
    logits, bias = torch.randn(t, 16, generator=g), torch.randn(16, generator=g) * 0.1
    cfg = RoutingConfig("deepseek_v3", renormalize=renorm, n_group=4, topk_group=2, has_correction_bias=True)
    got = route(logits, 4, cfg, bias)
    ids, w = _deepseek_loop(logits, bias, 4, 4, 2, renorm)
    assert torch.equal(got.ids.long(), ids)
    torch.testing.assert_close(got.weights.double(), w.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["softmax", "sigmoid"])
def test_softmax_and_sigmoid_routing(method):
    logits = torch.randn(5, 8)
    got = route(logits, 2, RoutingConfig(method, renormalize=False))
    if method == "softmax":
        ref = logits.softmax(-1).topk(2, dim=-1)
        assert torch.equal(got.ids.long(), ref.indices) and torch.allclose(got.weights, ref.values)
    else:  # Llama-4: top-k of the logits, then their sigmoids
        ref = logits.topk(2, dim=-1)
        assert torch.equal(got.ids.long(), ref.indices) and torch.allclose(got.weights, ref.values.sigmoid())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_routing_selects_on_logits_where_sigmoid_saturates(dtype):
    """float32 sigmoid is 1.0 from a logit of about 16.6 on: selecting on scores tied 18 and 25
    and gave the tie to expert 0 (Llama-4's router takes the larger logit)."""
    logits = torch.tensor([[18.0, 25.0, -3.0, 0.5], [17.0, 17.5, 18.0, 24.0]], dtype=dtype)
    got = route(logits, 1, RoutingConfig("sigmoid", renormalize=False))
    assert got.ids.view(-1).tolist() == [1, 3]
    assert torch.equal(got.weights, torch.sigmoid(logits.float().amax(-1, keepdim=True)))


def test_deepseek_v3_ranks_groups_by_top2_sum_without_a_bias_too():
    """Documented semantics (RoutingConfig): groups rank by the sum of their two best scores
    with or without a correction bias (DeepSeek-V3's gate, TensorRT-LLM), not by the best score
    as vLLM's grouped_topk does without a bias. Scores [0.9, 0.1 | 0.6, 0.6]: group 1 wins."""
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.6, 0.6]]))
    got = route(logits, 1, RoutingConfig("deepseek_v3", n_group=2, topk_group=1, renormalize=False))
    assert got.ids.tolist() == [[2]]


def test_grouped_deepseek_v3_routing_without_a_bias_is_refused_for_a_layer():
    """Without a bias the engines (DeepSeek's gate, vLLM, SGLang) rank groups by their best
    score, the oracle by the top-2 sum: here they keep different groups ([0.9, 0.1 | 0.6, 0.6]
    above). A layer refuses the config rather than disagree silently; a bias (zeros mean the
    sum rule), or keeping every group, is accepted."""
    cfg = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    with pytest.raises(moehal.ConfigError, match="has_correction_bias=True"):
        moehal.MoEConfig(**cfg, routing=RoutingConfig("deepseek_v3", n_group=4, topk_group=2))
    moehal.MoEConfig(**cfg, routing=RoutingConfig("deepseek_v3", n_group=4, topk_group=2, has_correction_bias=True))
    moehal.MoEConfig(**cfg, routing=RoutingConfig("deepseek_v3", n_group=4, topk_group=4))
    moehal.MoEConfig(**cfg, routing=RoutingConfig("deepseek_v3"))  # one group: no group ranking


def test_sigmoid_routing_renormalized_at_top1_is_refused():
    """One weight divided by itself is 1.0 for every token; Llama-4's router (renormalize off in
    SGLang and vLLM) weights the token by sigmoid(top logit)."""
    cfg = dict(num_experts=8, hidden_size=32, intermediate_size=16)
    with pytest.raises(moehal.ConfigError, match="renormalize=False"):
        moehal.MoEConfig(**cfg, top_k=1, routing=RoutingConfig("sigmoid"))
    moehal.MoEConfig(**cfg, top_k=1, routing=RoutingConfig("sigmoid", renormalize=False))
    moehal.MoEConfig(**cfg, top_k=2, routing=RoutingConfig("sigmoid"))
    # what renormalizing would have done: every weight exactly 1.0
    assert torch.equal(route(torch.randn(5, 8), 1, RoutingConfig("sigmoid")).weights, torch.ones(5, 1))


def test_layer_called_with_router_logits_equals_topk_call(registry):
    routing = RoutingConfig("deepseek_v3", n_group=2, topk_group=1, has_correction_bias=True)
    cfg = moehal.MoEConfig(
        num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, routing=routing, routed_scaling_factor=2.5
    )
    q = moehal.QuantScheme.parse("bf16")
    weights, x, _, _ = build_problem(cfg, q, 6)
    bias = torch.randn(8) * 0.1
    weights = weights.replace(correction_bias=bias)
    layer = moehal.MoELayer(cfg, q, device="cpu", registry=registry)
    layer.load_weights(weights)
    logits = torch.randn(6, 8).bfloat16()  # bf16 logits accepted; routing runs in fp32
    topk = route(logits, 2, routing, bias)
    torch.testing.assert_close(layer(x, router_logits=logits), layer(x, topk.ids, topk.weights))


def test_equal_scores_go_to_the_lower_expert_and_group_index():
    """The vendors' routing kernels order equal scores by the lower index; `torch.topk` leaves
    ties unspecified. bf16 logits tie often, so the oracle fixes the order: softmax, sigmoid and
    DeepSeek-V3's group and expert picks alike (the loop oracle above sorts stably too)."""
    logits = torch.tensor([[1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]).bfloat16()
    for method in ("softmax", "sigmoid"):
        assert route(logits, 3, RoutingConfig(method)).ids.tolist() == [[0, 1, 2]]
    # four groups of two, all scoring alike: the two lowest groups are kept, then the lowest experts
    flat = torch.zeros(1, 8)
    ds = RoutingConfig("deepseek_v3", n_group=4, topk_group=2)
    assert route(flat, 3, ds).ids.tolist() == [[0, 1, 2]]
    # many tokens of bf16 logits with ties, against the stable Python loop
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 16, generator=g) * 4).round().bfloat16().float()  # coarse: many ties
    want, _ = _deepseek_loop(logits, torch.zeros(16), 4, 4, 2, True)
    got = route(logits, 4, RoutingConfig("deepseek_v3", n_group=4, topk_group=2))
    assert torch.equal(got.ids.long(), want)
