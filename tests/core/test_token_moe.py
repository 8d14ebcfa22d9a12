"""The token-major decode kernels (`moehal.kernels.triton_token_moe`) against the reference
oracle, interpreted on CPU (compiled on a GPU), and the small-batch format that routes decode
batches to them: negotiated at build, taken by the layer at <= max_tokens tokens only."""

from __future__ import annotations

import moehal
import pytest
import torch
from moe_testing import build_problem
from moehal.formats import ActivationFormat, Layout, SmallBatchFormat, StandardInput
from moehal.kernels.tiles import TileConfig
from moehal.reference.dispatcher import ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts
from moehal.routing import TopK

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(cfg, weights, x, ids, wts):
    req = moehal.BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), moehal.detect("cpu"))
    fmt = ActivationFormat(Layout.STANDARD, cfg.dtype)
    disp, ex = ReferenceDispatcher().build(req, fmt), ReferenceExperts().build(req, fmt)
    ex.load(weights)
    inp, handle = disp.dispatch(x, TopK(ids, wts))
    return disp.combine(ex.apply(inp), handle), inp


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5),
        dict(activation="gelu", gated=False, has_w2_bias=True),
        dict(ep_size=2, ep_rank=1, top_k=3),  # ids of other ranks' experts are -1: skipped
        dict(dtype=torch.float16, top_k=1, apply_router_weight_on_input=True),
    ],
    ids=["silu", "swiglu-bias-scaled", "gelu-nongated", "ep-slice", "fp16-weight-on-input"],
)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("split", [1, None])  # None: the rule (here: the top-k split in parts)
def test_kernels_match_the_oracle(extra, tokens, split):
    from moehal.kernels.triton_fused_moe import _ACTS
    from moehal.kernels.triton_token_moe import token_gemm_act, token_gemm_combine

    base = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.bfloat16)
    cfg = moehal.MoEConfig(**{**base, **extra})
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("bf16"), tokens, seed=tokens)
    ref, inp = _reference(cfg, weights, x, ids, wts)  # inp: local ids, router weight applied
    w13, w2 = weights.w13.to(DEV), weights.w2.to(DEV)  # this rank's experts
    b13 = weights.w13_bias.float().to(DEV) if cfg.has_w13_bias else None
    b2 = weights.w2_bias.float().to(DEV) if cfg.has_w2_bias else None
    lids = inp.topk_ids.to(DEV)
    act = torch.zeros(tokens * cfg.top_k, cfg.intermediate_size, dtype=cfg.dtype, device=DEV)
    token_gemm_act(
        inp.hidden.to(DEV), lids, w13, b13, act, activation=_ACTS[cfg.activation.value], gated=cfg.gated,
        alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
    )  # fmt: skip
    out = torch.full((tokens, cfg.hidden_size), float("nan"), dtype=cfg.dtype, device=DEV)
    token_gemm_combine(act, lids, inp.topk_weights.to(DEV), w2, b2, out, scaling=cfg.routed_scaling_factor, split=split)
    again = torch.empty_like(out)  # the split parts are summed in a fixed order: bitwise repeatable
    token_gemm_combine(
        act, lids, inp.topk_weights.to(DEV), w2, b2, again, scaling=cfg.routed_scaling_factor, split=split
    )
    assert torch.equal(out, again)
    scale = ref.float().abs().max().clamp_min(1e-3)
    err = ((out.cpu().float() - ref.float()).abs().max() / scale).item()
    assert err < 1e-2, f"rel err {err:.4f}"
    if (lids < 0).any():  # a token whose experts are all elsewhere gets exact zeros
        dead = (lids < 0).all(dim=1).cpu()
        assert (out.cpu()[dead] == 0).all()


@pytest.mark.parametrize(
    "extra",
    [dict(), dict(activation="gelu", gated=False, has_w13_bias=True), dict(ep_size=2, ep_rank=1, top_k=3)],
    ids=["silu", "gelu-bias", "ep-slice"],
)
def test_nvfp4_activation_written_by_gemm1_equals_quantizing_after_it(extra):
    """`token_gemm_act(..., act_nvfp4_scale=)` writes the activation as NVFP4 block values:
    bitwise the plain kernel's output quantized by the reference (`moehal.quant.nvfp4`: codes
    times block scales, exact in bf16), over several N tiles of the activation."""
    from moehal.kernels.triton_fused_moe import _ACTS
    from moehal.kernels.triton_token_moe import token_gemm_act
    from moehal.quant import nvfp4

    def block_values(v, gs):  # the reference quantization, as the NVFP4 glue writes it
        return nvfp4.block_values(*nvfp4.quantize(v.float().cpu(), gs)).bfloat16().to(DEV)

    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=96, dtype=torch.bfloat16)
    cfg = moehal.MoEConfig(**{**base, **extra})
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("bf16"), 3, seed=7)
    _, inp = _reference(cfg, weights, x, ids, wts)
    lids = inp.topk_ids.to(DEV)
    w13 = weights.w13.to(DEV)
    b13 = weights.w13_bias.float().to(DEV) if cfg.has_w13_bias else None
    out_scale = (torch.rand(cfg.num_local_experts, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEV)
    xq, ga = block_values(x, 37.5), 211.0  # GEMM1's input as the NVFP4 experts quantize it
    scale = torch.tensor(ga, device=DEV)
    kw = dict(activation=_ACTS[cfg.activation.value], gated=cfg.gated, out_scale=out_scale)
    shape = (3 * cfg.top_k, cfg.intermediate_size)
    fused = torch.full(shape, float("nan"), dtype=cfg.dtype, device=DEV)
    token_gemm_act(xq, lids, w13, b13, fused, act_nvfp4_scale=scale, **kw)
    plain = torch.full(shape, float("nan"), dtype=cfg.dtype, device=DEV)
    token_gemm_act(xq, lids, w13, b13, plain, **kw)
    live = (lids.reshape(-1) >= 0).cpu()
    assert live.any() and torch.equal(fused.cpu()[live], block_values(plain[live.to(DEV)], ga).cpu())
    assert fused.cpu()[~live].isnan().all(), "slots of other ranks' experts are left as they are"
    with pytest.raises(ValueError, match="16-element groups"):
        bad = torch.empty(3 * cfg.top_k, 24, dtype=cfg.dtype, device=DEV)
        token_gemm_act(xq, lids, w13[:, :48] if cfg.gated else w13[:, :24], None, bad, act_nvfp4_scale=scale,
                       activation=kw["activation"], gated=cfg.gated)  # fmt: skip


def test_tiles_wider_than_the_problem_and_tuned_masked_tiles_are_adapted():
    """A tuned masked-GEMM tile (BLOCK_M 64) runs with the kernels' 16-row tile; N tiles wider
    than N are masked; a K tile that does not divide K is refused, not computed."""
    from moehal.kernels.triton_token_moe import token_gemm_act, token_gemm_combine

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("bf16"), 2)
    ref, inp = _reference(cfg, weights, x, ids, wts)
    w, lids, lw = weights.to(DEV), inp.topk_ids.to(DEV), inp.topk_weights.to(DEV)
    act = torch.empty(4, 32, dtype=torch.bfloat16, device=DEV)
    token_gemm_act(x.to(DEV), lids, w.w13, None, act, TileConfig(64, 64, 32, 1, 4, 1), activation=1, gated=True)
    out = torch.empty(2, 64, dtype=torch.bfloat16, device=DEV)
    token_gemm_combine(act, lids, lw, w.w2, None, out, TileConfig(64, 128, 32, 1, 4, 1))
    assert ((out.cpu().float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 1e-2
    with pytest.raises(ValueError, match="K tile"):
        token_gemm_combine(act, lids, lw, w.w2, None, out, TileConfig(16, 16, 48, 1, 4, 1))
    with pytest.raises(ValueError, match="does not divide"):
        token_gemm_combine(act, lids, lw, w.w2, None, out, TileConfig(16, 16, 32, 1, 4, 1), split=4)


def test_token_moe_binds_each_token_count_once_and_matches_the_functions():
    """`TokenMoE` (eager decode steps) launches what the checked functions launch, bitwise; it
    binds a token count on its first call and reuses the launches, and a call it cannot take
    (rows not contiguous) still goes through the checks and raises."""
    from moehal.kernels.triton_fused_moe import _ACTS
    from moehal.kernels.triton_token_moe import TokenMoE, token_gemm_act, token_gemm_combine

    cfg = moehal.MoEConfig(
        num_experts=8, top_k=4, hidden_size=128, intermediate_size=64, activation="swiglu_oai",
        has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    weights, *_ = build_problem(cfg, moehal.QuantScheme.parse("bf16"), 1)
    w13, w2 = weights.w13.to(DEV), weights.w2.to(DEV)
    b13, b2 = weights.w13_bias.float().to(DEV), weights.w2_bias.float().to(DEV)
    kw = dict(activation=_ACTS["swiglu_oai"], gated=True, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    moe = TokenMoE(w13, b13, w2, b2, scaling=2.5, **kw)
    g = torch.Generator().manual_seed(3)
    for t in (1, 3, 1, 3):
        x = torch.randn(t, 128, generator=g).bfloat16().to(DEV)
        ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(t)]).int().to(DEV)
        wts = torch.rand(t, 4, generator=g).to(DEV)
        act = torch.empty(t * 4, 64, dtype=torch.bfloat16, device=DEV)
        token_gemm_act(x, ids, w13, b13, act, **kw)
        want = token_gemm_combine(act, ids, wts, w2, b2, torch.empty(t, 128, dtype=torch.bfloat16, device=DEV),
                                  scaling=2.5)  # fmt: skip
        out = torch.full((t, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        assert moe(x, ids, wts, out) is out and torch.equal(out, want)
    assert sorted(moe._plans) == [(1, True), (3, True)]
    strided = torch.randn(128, 2, generator=g).bfloat16().to(DEV)[:, :1].t()  # [1, 128], column stride 2
    with pytest.raises(ValueError, match="contiguous"):
        moe(strided, ids[:1], wts[:1], torch.empty(1, 128, dtype=torch.bfloat16, device=DEV))


def test_token_moe_layers_of_one_shape_share_their_scratch_and_stay_exact():
    """The activation rows and a split combine's partial sums are process-wide scratch (no
    allocation per eager call): two layers of one shape share them, and calls alternating
    between the layers on one stream each give what the checked functions give."""
    from moehal.kernels.triton_fused_moe import _ACTS
    from moehal.kernels.triton_token_moe import TokenMoE, token_gemm_act, token_gemm_combine

    cfg = moehal.MoEConfig(num_experts=8, top_k=4, hidden_size=128, intermediate_size=64)
    kw = dict(activation=_ACTS["silu"], gated=True, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    layers = []
    for seed in (1, 2):
        weights, *_ = build_problem(cfg, moehal.QuantScheme.parse("bf16"), seed)
        w13, w2 = weights.w13.to(DEV), weights.w2.to(DEV)
        layers.append((TokenMoE(w13, None, w2, None, scaling=1.0, **kw), w13, w2))
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        moe, w13, w2 = layers[step % 2]
        x = torch.randn(1, 128, generator=g).bfloat16().to(DEV)
        ids = torch.randperm(8, generator=g)[:4].view(1, 4).int().to(DEV)
        wts = torch.rand(1, 4, generator=g).to(DEV)
        act = torch.empty(4, 64, dtype=torch.bfloat16, device=DEV)
        token_gemm_act(x, ids, w13, None, act, **kw)
        want = token_gemm_combine(act, ids, wts, w2, None, torch.empty(1, 128, dtype=torch.bfloat16, device=DEV))
        out = torch.full((1, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        assert torch.equal(moe(x, ids, wts, out), want)
    (first, second) = (layer[0]._plans[(1, True)] for layer in layers)
    assert first[2] is second[2]  # one activation buffer
    assert first[1].partial_numel and first[1]._split_buffers[0] is second[1]._split_buffers[0]


def test_combine_split_rule():
    from moehal.kernels.triton_token_moe import COMBINE_PROGRAMS, combine_split

    assert combine_split(8, 1, 2048, 32) == 4  # 64 (token, N tile) cells: 4 parts of 2 experts
    assert combine_split(8, 2, 2048, 32) == 2  # 128 cells -> 256 programs
    assert combine_split(8, 4, 2048, 32) == 1  # 256 cells: enough
    assert combine_split(2, 1, 4096, 32) == 2  # top-2: at most 2 parts
    assert combine_split(1, 1, 2048, 32) == 1  # one expert: nothing to split
    assert combine_split(8, 16, 4096, 32) == 1  # enough programs already
    assert combine_split(8, 64, 2048, 16) * 64 * 128 >= COMBINE_PROGRAMS


# --- the small-batch format through selection and the layer -----------------------------------


class SmallBatchExperts(ReferenceExperts):
    """Reference experts that consume masked input, and token-major input up to 2 tokens."""

    name = "small_batch"
    priority = 50
    fallback = False
    calls: list[str] = []

    def input_formats(self, req):
        return [ActivationFormat(Layout.MASKED, req.config.dtype)]

    def small_batch_format(self, req):
        return SmallBatchFormat(ActivationFormat(Layout.STANDARD, req.config.dtype), 2, "test")

    def build(self, req, fmt):
        runner = super().build(req, fmt)
        apply = runner.apply

        def spy(inp):
            SmallBatchExperts.calls.append(type(inp).__name__)
            return apply(inp)

        runner.apply = spy
        return runner


class MaskedOnlyDispatcher(ReferenceDispatcher):
    name = "masked_only"
    priority = 20

    def can_produce(self, fmt, req):
        if fmt.layout is not Layout.MASKED:
            return moehal.decline("moves masked batches only", "format")
        return super().can_produce(fmt, req)


def _registry(*dispatchers, experts=None):
    reg = moehal.Registry(moehal.Settings())

    class Plugin:
        @moehal.hookimpl
        def moehal_backend_info(self):
            return moehal.BackendInfo("smalltest", "0", "test plugin")

        @moehal.hookimpl
        def moehal_experts(self):
            return [experts or SmallBatchExperts()]

        @moehal.hookimpl
        def moehal_dispatchers(self):
            return list(dispatchers)

    reg.register(Plugin(), "smalltest")
    return reg


def test_small_batches_take_the_small_format_and_larger_ones_the_main():
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens=16)
    reg = _registry(ReferenceDispatcher())
    layer = moehal.MoELayer(cfg, "bf16", device="cpu", registry=reg)
    p = layer.plan.pipeline
    assert p.small is not None and p.small.max_tokens == 2 and p.fmt.layout is Layout.MASKED
    assert "small batch  at <= 2 tokens: standard[bfloat16] (test)" in str(layer.plan)
    assert layer.plan.as_dict()["pipeline"]["small_batch_max_tokens"] == 2
    # the same pairing without the small format is an alternative (conformance runs both)
    assert any(a.experts is p.experts and a.fmt == p.fmt and a.small is None for a in layer.plan.alternatives)
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("bf16"), 5)
    layer.load_weights(weights)
    for t, want in (
        (1, "StandardInput"),
        (2, "StandardInput"),
        (3, "MaskedInput"),
        (5, "MaskedInput"),
        (0, "StandardInput"),
    ):
        SmallBatchExperts.calls.clear()
        out = layer(x[:t], ids[:t], wts[:t])
        ref, _ = _reference(cfg, weights, x[:t], ids[:t], wts[:t])
        assert SmallBatchExperts.calls == [want]
        assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    # trace() takes the same branch
    SmallBatchExperts.calls.clear()
    assert isinstance(layer.trace(x[:1], ids[:1], wts[:1])["dispatched"], StandardInput)
    # a layout asked for by name rules the small format out
    masked = moehal.MoELayer(cfg, "bf16", device="cpu", registry=reg, layout="masked")
    assert masked.plan.pipeline.small is None


def test_trace_takes_the_format_it_is_asked_for():
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens=16)
    layer = moehal.MoELayer(cfg, "bf16", device="cpu", registry=_registry(ReferenceDispatcher()))
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("bf16"), 5)
    layer.load_weights(weights)
    for t, path, want in ((1, "main", "MaskedInput"), (5, "small", "StandardInput"), (1, "auto", "StandardInput")):
        stages = layer.trace(x[:t], ids[:t], wts[:t], path=path)
        assert type(stages["dispatched"]).__name__ == want, (t, path)
        ref, _ = _reference(cfg, weights, x[:t], ids[:t], wts[:t])
        assert torch.allclose(stages["out"].float(), ref.float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(moehal.InputError, match="path must be"):
        layer.trace(x, ids, wts, path="small-batch")
    plain = moehal.MoELayer(cfg, "bf16", device="cpu")  # the reference: no small-batch format
    plain.load_weights(weights)
    with pytest.raises(moehal.InputError, match="no small-batch format"):
        plain.trace(x, ids, wts, path="small")
    assert plain.trace(x, ids, wts, path="main")["out"].shape == x.shape


def test_a_dispatcher_that_cannot_produce_the_small_format_says_why():
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens=16)
    reg = _registry(MaskedOnlyDispatcher())
    layer = moehal.MoELayer(cfg, "bf16", device="cpu", registry=reg)
    assert layer.plan.pipeline.dispatcher.name == "masked_only" and layer.plan.pipeline.small is None
    why = [d for d in layer.plan.decisions if "at <= 2 tokens" in d.name]
    assert why and not why[0].ok and "moves masked batches only" in why[0].reason


class PrefillTooExperts(SmallBatchExperts):
    """Token-major input up to 2 tokens and at 6-12 tokens (a prefill band), masked otherwise."""

    name = "prefill_too"
    priority = 60

    def small_batch_format(self, req):
        return SmallBatchFormat(ActivationFormat(Layout.STANDARD, req.config.dtype), 2, "test", 6, "prefill test", 12)


def test_a_prefill_band_sends_large_batches_to_the_small_format_too():
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens=16)
    reg = _registry(ReferenceDispatcher(), experts=PrefillTooExperts())
    layer = moehal.MoELayer(cfg, "bf16", device="cpu", registry=reg)
    p = layer.plan.pipeline
    assert p.experts.name == "prefill_too" and p.small.prefill_min_tokens == 6
    assert "band         at 6-12 tokens: standard[bfloat16] (prefill test)" in str(layer.plan)
    assert layer.plan.as_dict()["pipeline"]["small_batch_prefill_min_tokens"] == 6
    assert layer.plan.as_dict()["pipeline"]["small_batch_prefill_max_tokens"] == 12
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("bf16"), 16)
    layer.load_weights(weights)
    for t, want in (
        (2, "StandardInput"),
        (3, "MaskedInput"),
        (5, "MaskedInput"),
        (6, "StandardInput"),
        (12, "StandardInput"),
        (13, "MaskedInput"),
    ):
        SmallBatchExperts.calls.clear()
        out = layer(x[:t], ids[:t], wts[:t])
        ref, _ = _reference(cfg, weights, x[:t], ids[:t], wts[:t])
        assert SmallBatchExperts.calls == [want], t
        assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
        SmallBatchExperts.calls.clear()
        assert type(layer.trace(x[:t], ids[:t], wts[:t])["dispatched"]).__name__ == want  # trace agrees
