"""DeepGEMM experts' glue (activation, bias, FP8 quant, stale-row zeroing) and the cuda.permute
dispatcher, end to end against the reference oracle. On CPU the GEMMs are a float32 torch
stand-in with DeepGEMM's contract (TorchGemmOps) and the Triton kernels run interpreted; on a
GPU with DeepGEMM, tests/cuda/test_gpu.py runs the real kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moehal.config import MoEConfig
from moehal.formats import ActivationFormat, Layout, ScaleKind, SmallBatchFormat, StandardInput
from moehal.hardware import detect
from moehal.interfaces import BuildRequest
from moehal.kernels.tiles import TileConfig
from moehal.kernels.triton_grouped_gemm import default_config
from moehal.quant import QuantScheme, ScaleFormat
from moehal.reference.dispatcher import ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts
from moehal.routing import TopK
from moehal.weights import quantize_weights
from moehal_cuda.deepgemm_experts import MASKED_ROW_ALIGNMENT, DeepGemmExpertsRunner, TorchGemmOps
from moehal_cuda.dispatch import CudaPermuteDispatcher
from moehal_cuda.gemm_choice import GemmChoice

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    ("bf16", Layout.MASKED, dict()),
    ("bf16", Layout.CONTIGUOUS, dict(has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5)),
    ("bf16", Layout.MASKED, dict(activation="gelu", gated=False, has_w2_bias=True)),
    ("bf16", Layout.MASKED, dict(activation="swiglu_oai", has_w13_bias=True)),
    ("fp8_block", Layout.MASKED, dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True)),
    ("fp8_block:ue8m0", Layout.CONTIGUOUS, dict(activation="gelu", ep_rank=1, ep_size=2)),
    ("fp8_block", Layout.CONTIGUOUS, dict(top_k=1, apply_router_weight_on_input=True)),
    # fp8 per-tensor: static input scales, quantized by the dispatcher and the activation
    ("fp8_tensor", Layout.MASKED, dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True)),
    ("fp8_tensor", Layout.CONTIGUOUS, dict(activation="gelu", ep_rank=1, ep_size=2, routed_scaling_factor=2.5)),
    ("fp8_tensor", Layout.CONTIGUOUS, dict(top_k=1, apply_router_weight_on_input=True)),
]


def _fmt(quant: QuantScheme, layout: Layout) -> ActivationFormat:
    # the row alignment the experts declare for the masked layout (DeepGEMM's tiles)
    masked = layout is Layout.MASKED
    align = MASKED_ROW_ALIGNMENT if masked else 8
    if quant.kind.value == "fp8_tensor":
        return ActivationFormat(layout, torch.float8_e4m3fn, ScaleKind.STATIC_TENSOR, align)
    if quant.kind.value == "fp8_block":
        ue = quant.scale_format is ScaleFormat.UE8M0
        return ActivationFormat(
            layout, torch.float8_e4m3fn, ScaleKind.GROUP_128_UE8M0 if ue else ScaleKind.GROUP_128, align
        )
    return ActivationFormat(layout, torch.bfloat16, ScaleKind.NONE, 1 if layout is Layout.STANDARD else align)


class AlwaysTriton:
    """A chooser that picks the Triton masked GEMM for every shape and batch (as a tuned table
    that found it faster everywhere would)."""

    def __init__(self):
        self.asked = []

    def choose(self, e, n, k, dtype, tokens):
        self.asked.append((e, n, k, dtype, tokens))
        return GemmChoice("triton", default_config(tokens, n, k, dtype == "fp8_block"), tokens)

    def prefill_fused(self, e, n13, k, tokens):
        return None

    def decode_fused(self, e, n13, k, dtype, tokens):
        return False, None


class TritonFp8FusedMeasured(AlwaysTriton):
    """Triton everywhere, and a table whose whole-layer FP8 decode records have the fused GEMM1
    faster at up to 3 tokens, on a tile of its own (4 programs per 1x128 group)."""

    def decode_fused(self, e, n13, k, dtype, tokens):
        assert dtype == "fp8_block"
        return (True, TileConfig(16, 32, 64, 1, 4, 1)) if tokens <= 3 else (False, None)


class TritonForSmallBatches(AlwaysTriton):
    """Triton (so, for bf16, GEMM1 fused with the activation) up to 16 tokens, DeepGEMM above:
    one layer switches between the fused and the unfused path on the same buffers."""

    def choose(self, e, n, k, dtype, tokens):
        self.asked.append((e, n, k, dtype, tokens))
        if tokens > 16:
            return GemmChoice("deepgemm", None, tokens)
        return GemmChoice("triton", default_config(tokens, n, k, dtype == "fp8_block"), tokens)


class TritonWithFusedTile(AlwaysTriton):
    """Triton everywhere, and GEMM1 rows that carry the fused kernel's own tile (a table tuned
    with `--fused-only`): a narrower N tile than the plain GEMM1's."""

    def choose(self, e, n, k, dtype, tokens):
        plain = super().choose(e, n, k, dtype, tokens)
        return GemmChoice("triton", plain.config, tokens, TileConfig(16, 16, 32, 1, 4, 1))


class DeepGemmWithPrefillFusion(AlwaysTriton):
    """DeepGEMM for both GEMMs, but batches of at least 5 tokens run GEMM1 as the fused GEMM1 +
    activation kernel (a table whose whole-layer prefill measurements favour fusion)."""

    def choose(self, e, n, k, dtype, tokens):
        self.asked.append((e, n, k, dtype, tokens))
        return GemmChoice("deepgemm", None, tokens)

    def prefill_fused(self, e, n13, k, tokens):
        return TileConfig(16, 16, 32, 1, 4, 1) if tokens >= 5 else None


# The masked cases again, with the Triton masked GEMM in place of DeepGEMM's (per-shape choice).
TRITON_GEMM_CASES = [(q, lay, {**x, "gemm": "triton"}) for q, lay, x in CASES if lay is Layout.MASKED]
# The FP8 masked cases with the Triton GEMMs and GEMM1 fused with the activation and the
# quantization of GEMM2's input at decode sizes (`fuse_fp8_gemm1_activation`), UE8M0 scales too.
FP8_FUSED_CASES = [
    (q, lay, {**x, "gemm": "triton", "fuse_fp8": True}) for q, lay, x in TRITON_GEMM_CASES if q.startswith("fp8")
] + [
    ("fp8_block:ue8m0", Layout.MASKED, dict(gemm="triton", fuse_fp8=True)),
    # the default: where the device's table measured the fused layer faster (here: 3 tokens)
    ("fp8_block", Layout.MASKED, dict(activation="swiglu_oai", has_w13_bias=True, gemm="fp8_measured")),
    ("fp8_tensor", Layout.MASKED, dict(gemm="fp8_measured")),
]
# The gated masked cases with DeepGEMM's GEMMs and prefill-sized batches fused (bf16 only).
PREFILL_FUSED_CASES = [
    (q, lay, {**x, "gemm": "prefill_fused"}) for q, lay, x in CASES if lay is Layout.MASKED and x.get("gated", True)
]


@pytest.mark.parametrize(
    "quant_name,layout,extra",
    CASES + TRITON_GEMM_CASES + FP8_FUSED_CASES + PREFILL_FUSED_CASES,
    ids=[f"{q}-{lay.value}-{i}" for i, (q, lay, _) in enumerate(CASES)]
    + [f"{q}-{lay.value}-triton-gemm-{i}" for i, (q, lay, _) in enumerate(TRITON_GEMM_CASES)]
    + [f"{q}-{lay.value}-fp8-fused-{i}" for i, (q, lay, _) in enumerate(FP8_FUSED_CASES)]
    + [f"{q}-{lay.value}-prefill-fused-{i}" for i, (q, lay, _) in enumerate(PREFILL_FUSED_CASES)],
)
def test_layer_matches_reference(quant_name, layout, extra):
    _check_layer(quant_name, layout, extra)


def _check_layer(quant_name, layout, extra) -> int:
    """Dispatch -> experts -> combine against the reference, call after call on shared buffers;
    returns how many calls ran the small-batch (token-major) path."""
    extra = dict(extra)
    choosers = {
        "triton": AlwaysTriton,
        "mixed": TritonForSmallBatches,
        "fused_tile": TritonWithFusedTile,
        "prefill_fused": DeepGemmWithPrefillFusion,
        "fp8_measured": TritonFp8FusedMeasured,
    }
    chooser = choosers.get(extra.pop("gemm", None), lambda: None)()
    # FP8 layers fuse GEMM1, the activation and GEMM2's quantization: always (True), never
    # (False), or where the chooser's whole-layer records say so (None, the default)
    fuse_fp8 = extra.pop("fuse_fp8", None)
    steps = extra.pop("steps", (12, 3, 7))  # later calls reuse buffers holding stale rows
    small = extra.pop("small_batch", 0)  # batches of <= this many tokens go token-major
    prefill = extra.pop("portable_prefill", None)  # ... and batches of >= this many (the portable fused MoE)
    kw = dict(num_experts=8, top_k=3, hidden_size=256, intermediate_size=128, max_tokens=max(steps))
    cfg = MoEConfig(**{**kw, **extra})
    quant = QuantScheme.parse(quant_name)
    g = torch.Generator().manual_seed(1)
    e = cfg.num_local_experts
    w13 = torch.randn(e, cfg.w13_rows, 256, generator=g) / 16
    w2 = torch.randn(e, 256, cfg.intermediate_size, generator=g) / 11
    b13 = torch.randn(e, cfg.w13_rows, generator=g) * 0.1 if cfg.has_w13_bias else None
    b2 = torch.randn(e, 256, generator=g) * 0.1 if cfg.has_w2_bias else None
    # fp8_tensor's static input scales come from it (its own generator: the calls' data stay as they were)
    calib = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    weights = quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=calib).to(DEV)
    req = BuildRequest(cfg, quant, detect(DEV))
    fmt = _fmt(quant, layout)
    fp8 = fmt.is_quantized
    disp = CudaPermuteDispatcher().build(req, fmt)
    static = fmt.scales is ScaleKind.STATIC_TENSOR
    if static:  # as the layer hands it over when it processes the weights
        disp.load_input_scale(weights.a13_scale.float().reshape(1))
    small_disp = CudaPermuteDispatcher().build(req, ActivationFormat(Layout.STANDARD, cfg.dtype))
    std = ActivationFormat(Layout.STANDARD, cfg.dtype)
    small_fmt = SmallBatchFormat(std, small, "", prefill) if small or prefill is not None else None
    ex = DeepGemmExpertsRunner(req, fmt, TorchGemmOps(fp8), chooser, small_fmt)
    ex.fuse_fp8_gemm1_activation = fuse_fp8
    ex.load(weights)
    # the oracle: static scales are the reference experts' own (they quantize bf16 input)
    ref_fmt = fmt.unquantized(cfg.dtype) if static else fmt
    rdisp = ReferenceDispatcher().build(req, ref_fmt)
    rex = ReferenceExperts().build(req, ref_fmt)
    rex.load(weights)
    rows_ex = ReferenceExperts().build(req, fmt)  # the reference experts on the dispatched rows
    rows_ex.load(weights)
    small_calls = 0
    for step, t in enumerate(steps):
        x = torch.randn(t, 256, generator=g).bfloat16().to(DEV)
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(t)]).int().to(DEV)
        topk = TopK(ids, (torch.rand(t, cfg.top_k, generator=g) + 0.1).to(DEV))
        token_major = small_fmt is not None and small_fmt.takes(t)
        d = small_disp if token_major else disp
        inp, handle = d.dispatch(x, topk)
        out = ex.apply(inp)
        y = d.combine(out, handle)
        rinp, rhandle = rdisp.dispatch(x, topk)
        ry = rdisp.combine(rex.apply(rinp), rhandle)
        scale = ry.float().abs().max().clamp_min(1e-3)
        # The interpreted Triton GEMM stores its bf16 output by truncation (the interpreter's
        # cast; a GPU rounds), so half of GEMM1's outputs sit one bf16 ulp under the oracle's,
        # all the same way. With static fp8_tensor scales that bias moves about 9% of GEMM2's
        # inputs by an fp8 step, and a 3-token batch then differs by up to 5.4% of its largest
        # output (4.6% L2). With static scales a one-step fp8 flip of GEMM2's input moves a
        # row by up to 1/16 of a value: the experts' own rows of biased swiglu_oai differ by
        # 4.1% of their largest on an H200 and on the CPU alike (session 42, where calibrating
        # on the biased activation moved the scale by 2%, and other values sit at the edges).
        loose = static
        tol = 2e-2 if not fp8 else (8e-2 if loose else 4e-2)
        err = ((y.float() - ry.float()).abs().max() / scale).item()
        # L2 bounds: conformance's for fp8 (0.035; 2.9% seen on an H100 for fp8_block at top-1)
        l2 = ((y.float() - ry.float()).norm() / ry.float().norm().clamp_min(1e-6)).item()
        assert err < tol, f"call {step}: rel err {err:.4f}"
        assert l2 < (2e-2 if not fp8 else (6e-2 if loose else 3.5e-2)), f"call {step}: rel L2 err {l2:.4f}"
        # the same call into a caller's buffer (`out=`): the last kernel writes it, same bits
        buf = torch.full_like(y, float("nan"))
        inp2, handle2 = d.dispatch(x, topk)
        into = ex.apply_into(inp2, buf)
        if token_major and t <= small and not static:
            assert into.hidden is buf  # the decode kernels wrote the result there
        elif not token_major:
            assert d._combine(into, handle2, buf) is buf  # the gather-and-sum kernel wrote it
        assert d.combine_into(into, handle2, buf) is buf and torch.equal(buf, y), f"call {step}: out= differs"
        if token_major:
            assert isinstance(inp, StandardInput)
            # the decode kernels apply routed scaling inside; the portable fused MoE (fp8_tensor's
            # decode batches too) leaves it to combine
            assert out.scaled == (t <= small and not static)
            small_calls += 1
            continue
        # experts' contract: padding rows of the output are zero
        if layout is Layout.MASKED:
            live = torch.arange(out.hidden.shape[1], device=DEV)[None, :] < inp.masked_m[:, None]
        else:
            r = torch.arange(out.hidden.shape[0], device=DEV)
            ex_id = inp.row_expert.long()
            c = ex_id.clamp(min=0)
            live = (ex_id >= 0) & (r - inp.segment_start.long()[c] < inp.counts.long()[c])
        pad = (out.hidden.float().abs().amax(-1) > 0) & ~live
        where = inp.row_expert.tolist() if layout is Layout.CONTIGUOUS else inp.masked_m.tolist()
        assert not pad.any(), f"call {step}: non-zero padding rows {torch.nonzero(pad).tolist()[:8]} of {where}"
        # the experts' rows themselves match the reference experts' rows on the same input
        ref_rows = rows_ex.apply(inp).hidden
        rs = ref_rows.float().abs().max().clamp_min(1e-3)
        assert ((out.hidden[live].float() - ref_rows[live].float()).abs().max() / rs).item() < tol
    if chooser is not None and not small:  # both GEMMs were chosen per call size: (E, N, K) of w13 and w2
        shapes = {(n, k) for _, n, k, _, _ in chooser.asked}
        assert shapes == {(cfg.w13_rows, 256), (256, cfg.intermediate_size)}
        from moehal_cuda.deepgemm_experts import FUSE_MAX_ROWS_PER_EXPERT

        prefill = isinstance(chooser, DeepGemmWithPrefillFusion)
        for bound, (_, _, fused) in ex._masked.items():
            # bf16 layers fuse GEMM1 with the activation when GEMM1 is Triton's and the batch is
            # decode-sized (at most FUSE_MAX_ROWS_PER_EXPERT rows per expert), or where the
            # table's prefill measurements say so (then the recorded choice is the fused tile)
            few = bound <= FUSE_MAX_ROWS_PER_EXPERT * e
            tile = chooser.prefill_fused(e, cfg.w13_rows, 256, bound // cfg.top_k) if cfg.gated else None
            want = tile is not None if prefill else ex.masked_choices[bound][0].triton and few
            if fp8:  # FP8: never in prefill; at decode sizes as the switch or the records say
                tokens = -(-bound // cfg.top_k)
                measured = chooser.decode_fused(e, cfg.w13_rows, 256, "fp8_block", tokens)
                want = want and not prefill and (fuse_fp8 if fuse_fp8 is not None else measured[0])
                if fused is not None and fuse_fp8 is None:  # the recorded tile is the fused kernel's
                    assert ex.masked_choices[bound][0].fused_config == measured[1]
            assert (fused is not None) == want
            if prefill and fused is not None:
                assert ex.masked_choices[bound][0].fused_config == tile
        # the fused and the unfused path both ran on these buffers (bf16; fp8 where it fuses)
        if not fp8 or fuse_fp8 or isinstance(chooser, TritonFp8FusedMeasured):
            assert {f is not None for _, _, f in ex._masked.values()} == {True, False}
        if prefill:
            assert all(not c[1].triton for c in ex.masked_choices.values())  # GEMM2 stays DeepGEMM's
        elif isinstance(chooser, TritonForSmallBatches):
            assert {c[0].triton for c in ex.masked_choices.values()} == {True, False}
        else:
            assert all(all(x.triton for x in c) for c in ex.masked_choices.values())
    return small_calls


@pytest.mark.parametrize(
    "extra",
    [
        dict(gemm="fused_tile"),
        dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5),
        dict(activation="gelu", gated=False, ep_rank=1, ep_size=2),
    ],
    ids=["fused-tile", "swiglu-bias-scaled", "gelu-ep-slice"],
)
def test_small_batches_run_token_major_between_masked_calls(extra):
    """The small-batch format (bf16): decode-sized calls run the token-major kernels on the
    runner built for masked input, between masked calls whose stale-row bookkeeping they
    must leave intact."""
    steps = (12, 1, 2, 7, 1, 3)
    small_calls = _check_layer("bf16", Layout.MASKED, {**extra, "small_batch": 2, "steps": steps})
    assert small_calls == 3  # the 1-, 2- and 1-token calls ran token-major, checked against the oracle


@pytest.mark.parametrize(
    "extra",
    [
        dict(small_batch=2),
        dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5),
        dict(activation="gelu", gated=False, ep_rank=1, ep_size=2, small_batch=1),
    ],
    ids=["silu-decode-too", "swiglu-bias-scaled", "gelu-ep-slice"],
)
def test_prefill_batches_run_the_portable_fused_moe_between_masked_calls(extra):
    """Prefill-sized calls (here >= 9 tokens) in the token-major format run the portable Triton
    fused MoE on the grouped GEMMs' own weight tensors, between masked calls (and decode calls)
    whose stale-row bookkeeping they must leave intact; every call checked against the oracle."""
    steps = (12, 1, 5, 9, 2, 7, 16)
    token_major = _check_layer("bf16", Layout.MASKED, {**extra, "portable_prefill": 9, "steps": steps})
    small = extra.get("small_batch", 0)
    assert token_major == 3 + sum(t <= small for t in steps)  # 12, 9 and 16 tokens ran the portable kernel


@pytest.mark.parametrize(
    "quant_name,extra",
    [
        ("fp8_block", dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5)),
        ("fp8_block:ue8m0", dict(activation="gelu", gated=False, ep_rank=1, ep_size=2)),
    ],
    ids=["fp8-swiglu-bias-scaled", "fp8-ue8m0-gelu-ep-slice"],
)
def test_fp8_prefill_batches_run_the_portable_fused_moe_on_deepgemms_scales(quant_name, extra):
    """fp8 layers (SM90 scales): prefill-sized calls reach the experts unquantized and run the
    portable fused MoE on DeepGEMM's fp8 weights and fp32 block scales (it quantizes the
    activations in 1x128 groups itself), between masked fp8 calls; no decode range (the decode
    kernels read bf16 weights only)."""
    steps = (12, 3, 9, 5, 16)
    assert _check_layer(quant_name, Layout.MASKED, {**extra, "portable_prefill": 9, "steps": steps}) == 3


@pytest.mark.parametrize("layout", [Layout.MASKED, Layout.CONTIGUOUS])
def test_fp8_tensor_decode_batches_run_the_portable_fused_moe_between_grouped_calls(layout):
    """fp8_tensor: batches of at most 4 tokens (here) go token-major to the portable kernel on
    the per-expert scales, the others through the grouped GEMMs on block scales; both against
    the oracle, call after call on shared buffers."""
    extra = dict(small_batch=4, steps=(7, 3, 12, 2), routed_scaling_factor=2.5)
    assert _check_layer("fp8_tensor", layout, extra) == 2


@pytest.mark.parametrize("quant_name", ["bf16", "fp8_block", "fp8_tensor"])
def test_contiguous_padding_rows_stay_zero_when_a_batch_shrinks(quant_name):
    """Rows live in a call of 12 tokens and padding in the next one, of 7, are zeroed by the
    activation. On an H100 the fp8_tensor kernel once kept them (Triton 3.6 dropped the
    zeroing stores that followed its static-scale loop; docs/device-runs/2026-11-24-session21)."""
    _check_layer(quant_name, Layout.CONTIGUOUS, dict(steps=(12, 7)))


def test_small_batch_format_is_declared_for_bf16_and_fp8_tensor_only(monkeypatch):
    from moehal_cuda.deepgemm_experts import DeepGemmExperts, small_batch_tokens

    cfg = MoEConfig(num_experts=128, top_k=8, hidden_size=256, intermediate_size=128)
    hw = detect("cpu")
    small = DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("bf16"), hw))
    assert small is not None and small.fmt.layout is Layout.STANDARD and small.max_tokens == small_batch_tokens(128, 8)
    assert small_batch_tokens(128, 8) == 4 and small_batch_tokens(8, 2) == 1 and small_batch_tokens(4, 8) == 1
    assert small_batch_tokens(32, 8, 704 * 2**20) == 0  # DeepSeek-V3's EP8 slice: masked at every size
    big = MoEConfig(num_experts=32, top_k=8, hidden_size=7168, intermediate_size=2048)
    assert DeepGemmExperts().small_batch_format(BuildRequest(big, QuantScheme.parse("bf16"), hw)) is None
    assert DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("fp8_block"), hw)) is None
    monkeypatch.setattr(DeepGemmExperts, "small_batch_max_tokens", 0)
    assert DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("bf16"), hw)) is None
    assert small.prefill_min_tokens is None  # on a CPU no table measured anything: no prefill range
    # fp8_tensor: the portable fused MoE for decode batches of every layer shape, DeepSeek's too
    # (no device table measured a band here: the default bound)
    from moehal_cuda.deepgemm_experts import FP8_TENSOR_PORTABLE_MAX_TOKENS

    for c in (cfg, big):
        fp8t = DeepGemmExperts().small_batch_format(BuildRequest(c, QuantScheme.parse("fp8_tensor"), hw))
        assert fp8t is not None and fp8t.max_tokens == FP8_TENSOR_PORTABLE_MAX_TOKENS
        assert fp8t.fmt == ActivationFormat(Layout.STANDARD, c.dtype) and fp8t.prefill_min_tokens is None
    monkeypatch.setattr(DeepGemmExperts, "fp8_tensor_portable_max_tokens", 0)
    assert DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("fp8_tensor"), hw)) is None


def test_fp8_tensor_band_comes_from_the_device_tables_measurements(monkeypatch, tmp_path):
    """fp8_tensor: where the device's table measured the layer shape (records keyed
    `dtype=fp8_tensor`), the portable kernel runs exactly where it won; a shape measured
    without a win runs the grouped GEMMs at every size; an unmeasured shape keeps the default
    decode bound; the class-level override wins over the table."""
    import json

    import moehal_cuda.gemm_choice as gc
    from moehal.hardware import HardwareInfo
    from moehal_cuda.deepgemm_experts import FP8_TENSOR_PORTABLE_MAX_TOKENS, DeepGemmExperts

    cfg = MoEConfig(num_experts=128, top_k=8, hidden_size=256, intermediate_size=128)
    big = MoEConfig(num_experts=32, top_k=8, hidden_size=7168, intermediate_size=2048)
    other = MoEConfig(num_experts=64, top_k=8, hidden_size=256, intermediate_size=128)
    gpu = HardwareInfo("cuda", torch.device("cuda", 0), "Test GPU 80GB", (9, 0))
    monkeypatch.setattr(gc, "TUNED_DIR", tmp_path)

    def rec(portable: dict[int, float]) -> dict:
        return {"layer_us": {str(t): {"current": 100.0, "portable": us} for t, us in portable.items()}}

    records = {
        # Qwen3-like: the portable kernel wins from 1 to 1024 tokens and loses at 2048 and 4096
        gc.layer_key(128, 256, 128, 8, True, "fp8_tensor"): rec({1: 97.0, 128: 95.0, 1024: 92.0, 2048: 104, 4096: 110}),
        # DeepSeek-like: never a win
        gc.layer_key(32, 7168, 2048, 8, True, "fp8_tensor"): rec({1: 100.5, 128: 101.0, 1024: 120.0}),
        # a bf16 record of the third shape is no fp8_tensor measurement
        gc.layer_key(64, 256, 128, 8, True, "bf16"): rec({1: 50.0}),
    }
    table = tmp_path / "masked_gemm.test_gpu_80gb.json"
    table.write_text(json.dumps({"entries": {}, "prefill_portable": records}))
    gc.load_table.cache_clear()
    try:
        q = QuantScheme.parse("fp8_tensor")
        small = DeepGemmExperts().small_batch_format(BuildRequest(cfg, q, gpu))
        assert small is not None and small.max_tokens == 1448 and small.prefill_min_tokens is None  # ~sqrt(1024 * 2048)
        assert [small.takes(t) for t in (1, 1448, 1449)] == [True, True, False]
        assert DeepGemmExperts().small_batch_format(BuildRequest(big, q, gpu)) is None
        unmeasured = DeepGemmExperts().small_batch_format(BuildRequest(other, q, gpu))
        assert unmeasured is not None and unmeasured.max_tokens == FP8_TENSOR_PORTABLE_MAX_TOKENS
        # a band that starts above one token: smaller batches run the grouped GEMMs
        key = gc.layer_key(128, 256, 128, 8, True, "fp8_tensor")
        records[key] = rec({1: 101.0, 256: 90.0, 1024: 91.0, 4096: 102.0})
        table.write_text(json.dumps({"entries": {}, "prefill_portable": records}))
        gc.load_table.cache_clear()
        small = DeepGemmExperts().small_batch_format(BuildRequest(cfg, q, gpu))
        assert small is not None
        assert (small.max_tokens, small.prefill_min_tokens, small.prefill_max_tokens) == (0, 17, 2048)
        assert [small.takes(t) for t in (1, 16, 17, 2048, 2049)] == [False, False, True, True, False]
        assert str(small) == "standard[bfloat16] at 17-2048 tokens"
        # a win up to the largest measured count: every batch from one token up, no bound
        records[key] = rec({1: 90.0, 4096: 90.0})
        table.write_text(json.dumps({"entries": {}, "prefill_portable": records}))
        gc.load_table.cache_clear()
        small = DeepGemmExperts().small_batch_format(BuildRequest(cfg, q, gpu))
        assert small is not None
        assert (small.max_tokens, small.prefill_min_tokens, small.prefill_max_tokens) == (0, 1, None)
        assert small.takes(1) and small.takes(1 << 20) and str(small) == "standard[bfloat16] at >= 1 tokens"
        monkeypatch.setattr(DeepGemmExperts, "fp8_tensor_portable_max_tokens", 8)  # the override wins
        small = DeepGemmExperts().small_batch_format(BuildRequest(big, q, gpu))
        assert small is not None and small.max_tokens == 8 and small.prefill_min_tokens is None
    finally:
        gc.load_table.cache_clear()


def test_prefill_range_joins_the_small_batch_format(monkeypatch, tmp_path):
    """A prefill band comes from the device's whole-layer measurements (or the class-level
    override a benchmark sets), for bf16 only; it is declared even where no decode batch runs
    token-major (DeepSeek-V3's EP8 slice), and shown by `moehal explain` through the plan."""
    import json

    import moehal_cuda.gemm_choice as gc
    from moehal.hardware import HardwareInfo
    from moehal_cuda.deepgemm_experts import DeepGemmExperts

    cfg = MoEConfig(num_experts=128, top_k=8, hidden_size=256, intermediate_size=128)
    big = MoEConfig(num_experts=32, top_k=8, hidden_size=7168, intermediate_size=2048)
    gpu = HardwareInfo("cuda", torch.device("cuda", 0), "Test GPU 80GB", (9, 0))
    path = tmp_path / "masked_gemm.test_gpu_80gb.json"
    monkeypatch.setattr(gc, "TUNED_DIR", tmp_path)

    def band(portable: dict[int, float], gated: bool = True):
        """The band for whole-layer times `portable` (the pipeline's: 100 us at every count)."""
        rec = {"layer_us": {str(t): {"current": 100.0, "portable": us} for t, us in portable.items()}}
        path.write_text(json.dumps({"entries": {}, "prefill_portable": {gc.layer_key(128, 256, 128, 8, True): rec}}))
        gc.load_table.cache_clear()
        return gc.GemmChooser("Test GPU 80GB").portable_prefill_range(128, 256, 128, 8, gated)

    # 64 tokens gained 0.5% (< PORTABLE_MIN_GAIN); from 128 on every count gained >= 1%: no upper bound,
    # and the lower one halfway (log scale) between the measured 64 and 128
    assert band({64: 99.5, 128: 90.0, 1024: 80.0, 4096: 98.0}) == (91, None)
    # an H200-like record: 64-512 win, 1024 does not, 2048 wins alone, 4096 loses
    h200 = {64: 95.0, 128: 94.0, 256: 98.0, 512: 93.0, 1024: 99.5, 2048: 98.7, 4096: 103.0}
    assert band(h200) == (64, 724)  # the longest run; 724 ~ sqrt(512 * 1024)
    assert band({64: 99.5, 4096: 99.5}) is None  # no count won
    assert band({64: 99.0, 4096: 101.0}) == (64, 512)  # a lone win at the smallest count
    assert band({64: 99.0}, gated=False) is None  # no record for this layer shape
    band({64: 99.5, 128: 90.0, 1024: 80.0, 4096: 98.0})
    small = DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("bf16"), gpu))
    assert small is not None and (small.prefill_min_tokens, small.prefill_max_tokens) == (91, None)
    assert small.max_tokens == 4 and [small.takes(t) for t in (4, 5, 90, 91, 8192)] == [True, False, False, True, True]
    assert str(small) == "standard[bfloat16] at <= 4 and >= 91 tokens"
    assert DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("fp8_block"), gpu)) is None
    # fp8 records are their own (dtype=fp8_block in the key): a band, and no decode range
    rec = {"layer_us": {"1024": {"current": 100.0, "portable": 90.0}, "4096": {"current": 100.0, "portable": 101.0}}}
    table = json.loads(path.read_text())
    table["prefill_portable"][gc.layer_key(128, 256, 128, 8, True, "fp8_block")] = rec
    path.write_text(json.dumps(table))
    gc.load_table.cache_clear()
    fp8 = DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("fp8_block"), gpu))
    assert fp8 is not None and (fp8.max_tokens, fp8.prefill_min_tokens, fp8.prefill_max_tokens) == (0, 1024, 2048)
    assert fp8.fmt == ActivationFormat(Layout.STANDARD, cfg.dtype), "unquantized: the kernel quantizes"
    sm100 = HardwareInfo("cuda", torch.device("cuda", 0), "Test GPU 80GB", (10, 0))
    assert DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("fp8_block"), sm100)) is None
    band(h200)
    small = DeepGemmExperts().small_batch_format(BuildRequest(cfg, QuantScheme.parse("bf16"), gpu))
    assert [small.takes(t) for t in (63, 64, 724, 725, 2048)] == [False, True, True, False, False]
    assert str(small) == "standard[bfloat16] at <= 4 and 64-724 tokens"
    # a shape the table has no record of: decode only
    other = MoEConfig(num_experts=64, top_k=8, hidden_size=256, intermediate_size=128)
    small = DeepGemmExperts().small_batch_format(BuildRequest(other, QuantScheme.parse("bf16"), gpu))
    assert small is not None and small.prefill_min_tokens is None
    gc.load_table.cache_clear()
    # the override: no decode range for DeepSeek-V3's slice, a prefill range all the same
    monkeypatch.setattr(DeepGemmExperts, "portable_prefill_min_tokens", 512)
    small = DeepGemmExperts().small_batch_format(BuildRequest(big, QuantScheme.parse("bf16"), gpu))
    assert small is not None and small.max_tokens == 0 and small.prefill_min_tokens == 512
    assert [small.takes(t) for t in (0, 1, 511, 512)] == [True, False, False, True]
    monkeypatch.setattr(DeepGemmExperts, "portable_prefill_min_tokens", 0)
    assert DeepGemmExperts().small_batch_format(BuildRequest(big, QuantScheme.parse("bf16"), gpu)) is None


def test_shipped_tables_send_qwen3_prefill_to_the_portable_kernel_where_measured():
    """The session-13 records as shipped: Qwen3-30B-A3B from 64 tokens up on an H100 and at
    64-724 tokens on an H200; DeepSeek-V3's EP8 slice and Mixtral never (measured slower); and
    session 14's fp8 record on the H200: never (the portable kernel 19-38% slower there)."""
    from moehal_cuda.gemm_choice import GemmChooser

    h100, h200 = GemmChooser("NVIDIA H100 80GB HBM3"), GemmChooser("NVIDIA H200")
    assert h100.portable_prefill_range(128, 2048, 768, 8, True) == (64, None)
    assert h200.portable_prefill_range(128, 2048, 768, 8, True) == (64, 724)
    assert h100.portable_prefill_range(32, 7168, 2048, 8, True) is None
    assert h100.portable_prefill_range(8, 4096, 14336, 2, True) is None
    assert "fp8_block" in str(h200.table["prefill_portable"])  # measured, and lost at every count
    assert h200.portable_prefill_range(128, 2048, 768, 8, True, "fp8_block") is None
    assert h100.portable_prefill_range(128, 2048, 768, 8, True, "fp8_block") is None  # not measured
    # fp8_tensor (sessions 22-23): Qwen3-30B-A3B on the portable kernel at 16-1024 tokens on both
    # GPUs; DeepSeek-V3's EP8 slice at 1-128 on tuned tiles (256 lost); Mixtral-8x7B at 16 alone
    # on the H100 (128 won too, but 64 lost between them: of two runs of one count, 16 saved more,
    # 3.2% against 1.6%) and on the H200 (128 lost there)
    for gpu in (h100, h200):
        assert gpu.portable_prefill_range(128, 2048, 768, 8, True, "fp8_tensor") == (5, 1448)
        assert gpu.portable_prefill_range(32, 7168, 2048, 8, True, "fp8_tensor") == (1, 181)
    assert h100.portable_prefill_range(8, 4096, 14336, 2, True, "fp8_tensor") == (5, 32)
    assert h200.portable_prefill_range(8, 4096, 14336, 2, True, "fp8_tensor") == (5, 45)


def test_gemm_choice_listing_shows_each_records_gain_and_band(capsys, monkeypatch):
    """`python -m moehal_cuda.gemm_choice "NVIDIA H100 80GB HBM3"`: each whole-layer record's rows
    with the measured gain, and the band the chooser makes of them on the layer's first row
    (Mixtral-8x7B fp8_tensor: 16 and 128 won, 64 lost between them, so the band is 5-32)."""
    from moehal_cuda import gemm_choice as gc

    monkeypatch.setenv("COLUMNS", "250")
    assert gc.main(["NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if "│" in line and "E=8,H=4096,I=14336" in line and "fp8_tensor" in line]
    cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows]
    assert [c[1] for c in cells][:4] == ["1", "16", "64", "128"]
    assert cells[0][-1] == "5-32" and all(c[-1] == "" for c in cells[1:])  # the band, once
    assert cells[1][4:6] == [f"{517.9 / 501.5:.3f}x", "yes"]  # 16 tokens: measured faster, inside
    assert cells[3][4:6] == [f"{528.2 / 519.9:.3f}x", "no"]  # 128: faster too, but not in the band
    notes = [line for line in out if line.startswith("E=8,H=4096,I=14336,top_k=2,gated=1,dtype=fp8_tensor:")]
    assert len(notes) == 2 and "the bound 5 lies between 16 tokens" in notes[0] and "16x apart" in notes[0]
    assert "the bound 32 lies between 16 tokens" in notes[1] and "and 64 (no win), 4x apart" in notes[1]


def test_band_edge_notes_name_the_bounds_that_rest_on_unmeasured_gaps():
    """A bound between measured counts at most 2x apart is not flagged; a wider gap is, on
    either edge, with the share of time the count inside the band saved."""
    from moehal_cuda.gemm_choice import band_edge_notes

    rec = {str(t): {"current": 100.0, "portable": us} for t, us in [(16, 110.0), (32, 98.0), (64, 97.0), (256, 105.0)]}
    notes = band_edge_notes(rec, (23, 128))  # the band of this record: 32-64 won
    assert len(notes) == 1 and notes[0].startswith("the bound 128 lies between 64 tokens")
    assert "saved 3.0%" in notes[0] and "256 (no win), 4x apart" in notes[0]
    rec["128"] = {"current": 100.0, "portable": 104.0}
    assert band_edge_notes(rec, (23, 90)) == []  # 16 | 32 and 64 | 128: both gaps 2x
    assert band_edge_notes(rec, (32, None)) == []  # 16 | 32 is 2x; no upper bound, no upper edge


@pytest.mark.parametrize("quant_name,layout", [("fp8_block", Layout.MASKED), ("bf16", Layout.CONTIGUOUS)])
def test_activation_split_over_column_chunks(monkeypatch, quant_name, layout):
    """Wide layers run the activation as (row block x column chunk) programs, each with its own
    bitmap cell per row: stale rows must still be zeroed in every chunk of `out` and `y`."""
    import moehal_cuda.triton_glue as glue

    monkeypatch.setattr(glue, "ACT_COL_SPAN", 128)
    assert glue.activation_chunks(384) == 3
    _check_layer(quant_name, layout, dict(intermediate_size=384, has_w2_bias=True))


@pytest.mark.parametrize("blocks", [2, 4])
@pytest.mark.parametrize(
    "quant_name,layout",
    [
        ("fp8_block", Layout.MASKED),
        ("fp8_block", Layout.CONTIGUOUS),
        ("fp8_tensor", Layout.CONTIGUOUS),
        ("bf16", Layout.MASKED),
    ],
)
def test_activation_loads_several_column_blocks_at_a_time(monkeypatch, quant_name, layout, blocks):
    """`ActTile.blocks_per_load`: one load of 2 or 4 column blocks (fp8: that many 1x128 groups
    quantized together). 384 columns in one 512-column chunk: the last load runs past the row,
    and its groups past the row store no scale."""
    import moehal_cuda.triton_glue as glue

    monkeypatch.setattr(glue, "act_tile", lambda rows, block_i: glue.ActTile(16, glue.ACT_COL_SPAN, 4, blocks))
    _check_layer(quant_name, layout, dict(intermediate_size=384))


@pytest.mark.parametrize("gemm", ["deepgemm", "triton", "mixed", "fused_tile"])
def test_masked_shrink_after_a_large_batch(monkeypatch, gemm):
    """A prefill-sized call, then decode-sized ones: the stale rows of the activation and GEMM2
    output buffers are zeroed by several programs per expert and column chunk (the last to
    finish records the new counts), and the grids cover only the routed rows."""
    import moehal_cuda.triton_glue as glue
    from moehal.kernels.triton_permute import stale_splits

    monkeypatch.setattr(glue, "ACT_COL_SPAN", 128)
    assert stale_splits(256, 16, 8) > 1
    _check_layer("bf16", Layout.MASKED, dict(intermediate_size=384, has_w2_bias=True, steps=(200, 2, 40, 1), gemm=gemm))


@pytest.mark.parametrize("quant_name", ["bf16", "fp8_block"])
def test_masked_batches_of_one_size_reuse_the_bound_activation(monkeypatch, quant_name):
    """The masked path binds its activation launch once per (rows bound, E, max_m) (host time
    of an eager step): later batches of that size, with other routings and row counts, reuse it
    and still match the reference; another size binds its own."""
    import moehal_cuda.triton_glue as glue

    bound_for = []
    real = glue.bind_activation

    def counted(*args, **kwargs):
        bound_for.append(args[3].total_rows)  # the RowIndex's bound: tokens x top_k
        return real(*args, **kwargs)

    monkeypatch.setattr(glue, "bind_activation", counted)
    _check_layer(quant_name, Layout.MASKED, dict(steps=(6, 6, 4, 6)))
    assert bound_for == [18, 12], "one bind per batch size, kept across its calls"


@pytest.mark.parametrize("hidden", [64, 320])
@pytest.mark.parametrize("split", [True, False], ids=["chunk-per-program", "serial-chunks"])
def test_nvfp4_qdq_kernel_matches_reference_exactly(monkeypatch, hidden, split):
    """Both of the quantizer's column walks (`QDQ_SPLIT_COLUMNS`), over one chunk and over
    three (320 columns: 128 + 128 + a masked 64)."""
    import moehal_cuda.triton_glue as tg
    from moehal.quant import nvfp4
    from moehal_cuda.triton_glue import RowIndex, nvfp4_qdq_rows

    monkeypatch.setattr(tg, "QDQ_SPLIT_COLUMNS", split)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 8, hidden, generator=g) * 3).bfloat16().to(DEV)
    gs = torch.tensor(37.5, device=DEV)
    mm = torch.tensor([5, 8], dtype=torch.int32, device=DEV)
    out = torch.zeros_like(x)
    nvfp4_qdq_rows(x, out, gs, RowIndex(16, 8, masked_m=mm))
    # the codes times their block scales: the reference's quantize-dequantize times the global
    # scale, which bf16 holds exactly (the GEMM divides by the global scale after its sum)
    ref = nvfp4.block_values(*nvfp4.quantize(x.float().cpu(), 37.5))
    assert torch.equal(ref.bfloat16().float(), ref), "block values are exact in bf16"
    assert torch.equal(ref / 37.5, nvfp4.qdq(x.float().cpu(), 37.5))
    assert torch.equal(out[0, :5].cpu(), ref[0, :5].bfloat16()) and torch.equal(out[1].cpu(), ref[1].bfloat16())
    assert (out[0, 5:] == 0).all()


def _nvfp4_layer(layout: Layout, w13_bias: bool, tiles=None):
    """A small NVFP4 layer through the Hopper experts and the reference experts, one batch
    dispatched: (experts runner, its input, its output, the reference's output, live rows)."""
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantRunner

    cfg = MoEConfig(
        num_experts=6, top_k=2, hidden_size=128, intermediate_size=64, max_tokens=8, has_w13_bias=w13_bias,
        has_w2_bias=True,
    )  # fmt: skip
    quant = QuantScheme.parse("nvfp4")
    g = torch.Generator().manual_seed(4)
    w13 = torch.randn(6, 128, 128, generator=g) / 11
    w2 = torch.randn(6, 128, 64, generator=g) / 8
    x = torch.randn(8, 128, generator=g)
    b13 = torch.randn(6, 128, generator=g) * 0.3 if w13_bias else None
    b2 = torch.randn(6, 128, generator=g) * 0.1
    weights = quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=x)
    weights = weights.to(DEV)
    req = BuildRequest(cfg, quant, detect(DEV))
    fmt = _fmt(QuantScheme.parse("bf16"), layout)  # the experts' alignment (bf16: they dequantize first)
    if layout is Layout.CONTIGUOUS:  # DeepGEMM's: the Triton GEMM's tiles hold one segment each
        fmt = dataclasses.replace(fmt, row_alignment=128)
    disp = CudaPermuteDispatcher().build(req, fmt)
    ex = Nvfp4DequantRunner(req, fmt, TorchGemmOps(False), tiles)
    ex.load(weights)
    rex = ReferenceExperts().build(req, fmt)
    rex.load(weights)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(8)]).int().to(DEV)
    inp, _ = disp.dispatch(x.bfloat16().to(DEV), TopK(ids, torch.ones(8, 2, device=DEV)))
    out, ref = ex.apply(inp).hidden, rex.apply(inp).hidden
    if layout is Layout.MASKED:
        live = torch.arange(out.shape[1], device=DEV)[None, :] < inp.masked_m[:, None]
    else:
        live = inp.row_expert >= 0  # the rows that hold a token (padding rows read -1)
    return ex, inp, out, ref, live


def _rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("w13_bias", [False, True])
@pytest.mark.parametrize("layout", [Layout.MASKED, Layout.CONTIGUOUS])
def test_nvfp4_dequant_experts_follow_the_scheme(layout, w13_bias):
    _, _, out, ref, live = _nvfp4_layer(layout, w13_bias)
    # one rounding per GEMM, as the reference's, biases included (in the GEMMs' epilogues since
    # session 50): on the CPU every output equals the reference's. Before session 49 the
    # dequantized operands were rounded to bf16 value by value, and this error was 4.8e-2; until
    # session 50 the w2 bias was added to GEMM2's rounded output: 2.5e-3. A GPU's dot sums in
    # another order than torch's, which may move an output by one bf16 step (2^-8 of it).
    err = _rel_max(out[live], ref[live])
    assert err < (1e-3 if DEV == "cpu" else 4e-3), err
    assert (out[~live] == 0).all(), "padding rows are zero"


@pytest.mark.parametrize("layout", [Layout.MASKED, Layout.CONTIGUOUS])
def test_nvfp4_dequant_experts_take_the_tables_triton_tiles(layout, tmp_path):
    """The NVFP4 experts' GEMMs (always Triton) run the tile the device's table measured for the
    same bf16 GEMM shape (`GemmChooser.triton_tile`), whichever kernel won there; masked batches
    keep their bound launches from one call to the next."""
    import json

    from moehal_cuda.gemm_choice import GemmChooser, entry_key, table_path

    t1, t2 = TileConfig(16, 32, 64, 1, 4, 1), TileConfig(32, 64, 64, 2, 4, 1)
    entries = {
        entry_key(6, 128, 128, "bf16"): {"8": {"use": "deepgemm", "config": t1.as_dict()}},
        entry_key(6, 128, 64, "bf16"): {"8": {"use": "triton", "config": t2.as_dict()}},
    }
    table_path("Test GPU", tmp_path).write_text(json.dumps({"meta": {}, "entries": entries}))
    ex, inp, out, ref, live = _nvfp4_layer(layout, True, GemmChooser("Test GPU", tmp_path))
    assert ex.tile_configs(16) == (t1, t2)
    assert _rel_max(out[live], ref[live]) < (1e-3 if DEV == "cpu" else 4e-3)
    if layout is Layout.MASKED:
        ((g1, g2),) = ex._launches.values()
        assert (g1.kw["BLOCK_N"], g2.kw["BLOCK_N"], g2.kw["BLOCK_M"]) == (32, 64, 32)
        again = ex.apply(inp).hidden
        kept = ex._launches[inp.total_rows_bound]
        assert torch.equal(again, out) and kept[0] is g1 and kept[1] is g2, "the launches are kept"
    ex.tuned_tiles = False
    assert ex.tile_configs(16) == (None, None)


def test_nvfp4_masked_batches_keep_their_quantizer_and_activation_launches():
    """Masked batches bind the input quantizer and the activation once per row bound and keep
    them (host time of an eager step): a later batch of the same bound, routed elsewhere, reads
    its own row counts through the kept launches and gets what a fresh runner gets; new weights
    (new global scales) bind them again."""
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantRunner

    ex, inp, out, ref, live = _nvfp4_layer(Layout.MASKED, False)
    ((quantize, act, bufs),) = ex._glue.values()
    assert quantize.masked and bufs[0].shape == inp.hidden.shape
    fmt = ex.fmt
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 128, generator=g).bfloat16().to(DEV)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(8)]).int().to(DEV)
    first = inp.masked_m.clone()
    disp = CudaPermuteDispatcher().build(ex.req, fmt)
    inp2, _ = disp.dispatch(x, TopK(ids, torch.ones(8, 2, device=DEV)))
    # row counts in a tensor of their own (a dispatcher need not reuse one): read per call
    inp2 = dataclasses.replace(inp2, masked_m=inp2.masked_m.clone())
    inp.masked_m.copy_(first)  # and the tensor the launches were bound with says the first batch's
    assert inp2.total_rows_bound == inp.total_rows_bound and not torch.equal(inp2.masked_m, first)
    kept = ex.apply(inp2).hidden.clone()
    assert ex._glue[(inp2.total_rows_bound, 6, inp2.hidden.shape[1])][0] is quantize, "the launches are kept"
    fresh = Nvfp4DequantRunner(ex.req, fmt, TorchGemmOps(False))
    fresh.load(ex.w)
    live2 = torch.arange(kept.shape[1], device=DEV)[None, :] < inp2.masked_m[:, None]
    assert torch.equal(kept[live2], fresh.apply(inp2).hidden[live2])
    assert (kept[~live2] == 0).all(), "rows the first batch wrote and this one did not are zeroed"
    ex.load(ex.w)
    assert not ex._glue, "new weights: new global scales, bound again"
    assert torch.equal(ex.apply(inp2).hidden, kept)


def test_nvfp4_tile_lookups_are_kept_per_row_count(monkeypatch):
    """Contiguous batches ask for their tiles on every call: a row count's lookup is kept (the
    last `TILE_MEMO` counts, least recently used out), and gives what a fresh lookup gives."""
    import moehal_cuda.nvfp4_dequant as nd
    from moehal_cuda.gemm_choice import GemmChooser

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    req = BuildRequest(cfg, QuantScheme.parse("nvfp4"), detect(DEV))
    fmt = _fmt(QuantScheme.parse("bf16"), Layout.CONTIGUOUS)
    ex = nd.Nvfp4DequantRunner(req, fmt, None, GemmChooser("NVIDIA H200"))
    looked: list[int] = []
    real = ex._lookup_tiles
    monkeypatch.setattr(ex, "_lookup_tiles", lambda rows: looked.append(rows) or real(rows))
    monkeypatch.setattr(nd, "TILE_MEMO", 3)
    for rows in (256, 512, 256, 1024, 2048, 256, 512):
        assert ex.tile_configs(rows) == real(rows)
    # 256 stays (used again before it was the oldest); 512 had left when 2048 came in
    assert looked == [256, 512, 1024, 2048, 512] and list(ex._tile_memo) == [2048, 256, 512]


class _NoGemm(TorchGemmOps):
    """Fails the test if a GEMM is launched: empty inputs must not reach DeepGEMM, which
    rejects empty operands (seen on 2 x H200, 2026-11-22: an EP rank that received no rows)."""

    def masked(self, *args, **kwargs):
        raise AssertionError("GEMM launched on an empty input")

    contiguous = masked


@pytest.mark.parametrize("layout", [Layout.MASKED, Layout.CONTIGUOUS])
def test_empty_input_skips_the_gemms(layout):
    from moehal.formats import ContiguousInput, MaskedInput

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    req = BuildRequest(cfg, QuantScheme.parse("bf16"), detect(DEV))
    fmt = _fmt(QuantScheme.parse("bf16"), layout)
    ex = DeepGemmExpertsRunner(req, fmt, _NoGemm(False))
    g = torch.Generator().manual_seed(0)
    w = quantize_weights(
        cfg, QuantScheme.parse("bf16"), torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g)
    ).to(DEV)
    ex.load(w)
    zeros = torch.zeros(4, dtype=torch.int32, device=DEV)
    if layout is Layout.MASKED:
        inp = MaskedInput(torch.zeros(4, 0, 256, dtype=torch.bfloat16, device=DEV), None, zeros, 1)
    else:
        empty_rows = torch.zeros(0, dtype=torch.int32, device=DEV)
        inp = ContiguousInput(torch.zeros(0, 256, dtype=torch.bfloat16, device=DEV), None, empty_rows, zeros, zeros)
    out = ex.apply(inp).hidden
    assert out.shape == (*inp.hidden.shape[:-1], 256) and out.dtype == torch.bfloat16


def test_misaligned_masked_input_is_refused_not_computed():
    from moehal.formats import MaskedInput
    from moehal_cuda.deepgemm_experts import MASKED_ROW_ALIGNMENT

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    req = BuildRequest(cfg, QuantScheme.parse("bf16"), detect(DEV))
    fmt = ActivationFormat(Layout.MASKED, torch.bfloat16, ScaleKind.NONE, MASKED_ROW_ALIGNMENT)
    ex = DeepGemmExpertsRunner(req, fmt, _NoGemm(False))
    g = torch.Generator().manual_seed(0)
    ex.load(
        quantize_weights(
            cfg, QuantScheme.parse("bf16"), torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g)
        ).to(DEV)
    )
    inp = MaskedInput(
        torch.zeros(4, 9, 256, dtype=torch.bfloat16, device=DEV), None, torch.ones(4, dtype=torch.int32, device=DEV), 1
    )
    with pytest.raises(ValueError, match=f"not a multiple of {MASKED_ROW_ALIGNMENT}"):
        ex.apply(inp)
    # 64 rows per expert: whole 64-row tiles, but DeepGEMM may take 128-row ones (session 40)
    inp64 = MaskedInput(inp.hidden.new_zeros(4, 64, 256), None, inp.masked_m, 1)
    with pytest.raises(ValueError, match="max_m=64, not a multiple of 128"):
        ex.apply(inp64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=90.0, max_value=110.0), min_size=1, max_size=8))
def test_prefill_band_is_the_longest_run_of_measured_wins(portable_us):
    """For any record: every measured count inside the band won by the margin, the band holds
    exactly the longest run of wins (on a tie, the one saving the larger summed share of time,
    then the larger counts), and no band means no win."""
    import math

    from moehal_cuda import gemm_choice as gc

    counts = [2 ** (5 + j) for j in range(len(portable_us))]  # 32, 64, ...
    rec = {"layer_us": {str(t): {"current": 100.0, "portable": us} for t, us in zip(counts, portable_us)}}
    chooser = gc.GemmChooser(None)
    chooser.table = {"prefill_portable": {gc.layer_key(8, 64, 32, 2, True): rec}}
    band = chooser.portable_prefill_range(8, 64, 32, 2, True)
    wins = [us <= (1.0 - gc.PORTABLE_MIN_GAIN) * 100.0 for us in portable_us]
    if band is None:
        assert not any(wins)
        return
    lo, hi = band
    inside = [j for j, t in enumerate(counts) if lo <= t <= (hi if hi is not None else math.inf)]
    assert inside and all(wins[j] for j in inside)
    assert inside == list(range(inside[0], inside[-1] + 1))  # one run of measured counts
    runs, j = [], 0
    while j < len(wins):  # every run of wins, as (length, share of time saved, start)
        if wins[j]:
            k = j
            while k + 1 < len(wins) and wins[k + 1]:
                k += 1
            runs.append((k - j + 1, sum(1.0 - portable_us[m] / 100.0 for m in range(j, k + 1)), j))
            j = k + 1
        else:
            j += 1
    length, share, start = max(runs)  # the longest; on a tie the larger saving, then the larger counts
    assert (len(inside), inside[0]) == (length, start)
    assert all(r[1] <= share for r in runs if r[0] == length)
    assert (hi is None) == (inside[-1] == len(counts) - 1)


def _fake_deep_gemm(monkeypatch) -> list[tuple]:
    """A stand-in `deep_gemm` whose SM100 weight-scale transform records its calls."""
    import types

    from moehal_cuda import support

    calls: list[tuple] = []

    def transform(sf, mn, k, recipe, num_groups=None, is_sfa=None):
        calls.append((tuple(sf.shape), mn, k, recipe, num_groups, is_sfa))
        return sf

    fake = types.ModuleType("deep_gemm")
    fake.transform_sf_into_required_layout = transform
    monkeypatch.setitem(support._DG, "mod", fake)
    return calls


def test_sm100_weights_get_their_scale_transform_whoever_loads_them(monkeypatch):
    """fp8_block:ue8m0 on SM100: canonical weights handed to the runner directly (no weight
    processor) get DeepGEMM's scale transform too, as the processor's do; and scales that are not
    powers of two are refused on the host, where DeepGEMM's device assert would kill the CUDA
    context at load."""
    from moehal.errors import WeightError
    from moehal.hardware import HardwareInfo
    from moehal_cuda.deepgemm_experts import DeepGemmWeightProcessor

    calls = _fake_deep_gemm(monkeypatch)
    sm100 = HardwareInfo("cuda", torch.device("cuda", 0), "Test B200", (10, 0))
    # W13 not square (2I = 512 rows, H = 256): transform_sf_into_required_layout(sf, mn, k, ...)
    # takes mn = the weight's rows, k = its columns
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256)
    quant = QuantScheme.parse("fp8_block:ue8m0")
    g = torch.Generator().manual_seed(0)
    w = quantize_weights(cfg, quant, torch.randn(4, 512, 256, generator=g), torch.randn(4, 256, 256, generator=g))
    req = BuildRequest(cfg, quant, sm100)
    runner = DeepGemmExpertsRunner(req, _fmt(quant, Layout.MASKED), TorchGemmOps(True))
    runner.load(w)
    assert calls == [((4, 4, 2), 512, 256, (1, 128, 128), 4, False), ((4, 2, 2), 256, 256, (1, 128, 128), 4, False)]
    for sf, mn, k, *_ in calls:  # each scale tensor is [E, ceil(mn/128), ceil(k/128)]
        assert sf[1:] == (-(-mn // 128), -(-k // 128))
    DeepGemmWeightProcessor().process(w, req)
    assert calls[2:] == calls[:2]  # the processor's call, the same
    bad = dataclasses.replace(w, w2_scale=w.w2_scale * 1.5)  # fp8_block scales, not UE8M0
    with pytest.raises(WeightError, match="w2_scale: .* not finite positive powers of two"):
        runner.load(bad)


def test_sm100_weights_with_negative_power_of_two_scales_are_refused(monkeypatch):
    """SM100's UE8M0 packing keeps the exponent only: a negative scale (sign bit set, mantissa
    zero) is not a positive power of two and is refused on the host like any other."""
    from moehal.errors import WeightError
    from moehal.hardware import HardwareInfo

    _fake_deep_gemm(monkeypatch)
    sm100 = HardwareInfo("cuda", torch.device("cuda", 0), "Test B200", (10, 0))
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    quant = QuantScheme.parse("fp8_block:ue8m0")
    g = torch.Generator().manual_seed(1)
    w = quantize_weights(cfg, quant, torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g))
    runner = DeepGemmExpertsRunner(BuildRequest(cfg, quant, sm100), _fmt(quant, Layout.MASKED), TorchGemmOps(True))
    runner.load(w)  # the same weights with positive scales load
    scale = w.w13_scale.clone()
    scale[1, 0, 1] = -scale[1, 0, 1]  # -2^k: mantissa bits zero, sign bit set
    with pytest.raises(WeightError, match="w13_scale: 1 of .* not finite positive powers of two"):
        runner.load(dataclasses.replace(w, w13_scale=scale))


def test_nvfp4_qdq_kernel_rounds_exact_ties_to_even():
    """Values exactly halfway between two e2m1 neighbours (block scale exactly 1, global scale
    1) round to the even neighbour, as cvt.rn and the reference do: 1.25 -> 1.0, 1.75 -> 2.0."""
    from moehal.quant import nvfp4
    from moehal_cuda.triton_glue import RowIndex, nvfp4_qdq_rows

    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # block amax 6: scale 1.0
    x = torch.stack([row, -row]).reshape(1, 2, 16).repeat(1, 1, 4).bfloat16().to(DEV)
    out = torch.zeros_like(x)
    mm = torch.tensor([2], dtype=torch.int32, device=DEV)
    nvfp4_qdq_rows(x, out, torch.tensor(1.0, device=DEV), RowIndex(2, 2, masked_m=mm))
    ref = nvfp4.qdq(x.float().cpu(), 1.0).bfloat16()
    assert ref[0, 0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize(
    "extra",
    [
        dict(has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5),
        dict(activation="gelu", gated=False, ep_rank=1, ep_size=2, has_w2_bias=True),
        dict(activation="swiglu_oai", top_k=4),
    ],
    ids=["silu-bias-scaled", "gelu-ep-slice", "swiglu-top4"],
)
def test_nvfp4_decode_batches_run_token_major_as_the_masked_path(extra, monkeypatch):
    """The NVFP4 experts' token-major decode path (`Nvfp4DequantRunner._apply_tokens`: the input
    and the activation quantized inside the decode kernels, the global scales in their
    epilogues) computes what their masked path computes, and both what the reference layer
    does; its kernels write the caller's buffer and apply the routed scaling."""
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts, Nvfp4DequantRunner

    monkeypatch.setattr(Nvfp4DequantExperts, "small_batch_max_tokens", None)  # the default, whatever it becomes
    cfg = MoEConfig(**{**dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64, max_tokens=4), **extra})
    quant = QuantScheme.parse("nvfp4")
    g = torch.Generator().manual_seed(5)
    e = cfg.num_local_experts
    w13 = torch.randn(e, cfg.w13_rows, 128, generator=g) / 11
    w2 = torch.randn(e, 128, 64, generator=g) / 8
    b13 = torch.randn(e, cfg.w13_rows, generator=g) * 0.3 if cfg.has_w13_bias else None
    b2 = torch.randn(e, 128, generator=g) * 0.1 if cfg.has_w2_bias else None
    calib = torch.randn(8, 128, generator=g)
    weights = quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=calib).to(DEV)
    req = BuildRequest(cfg, quant, detect(DEV))
    small = Nvfp4DequantExperts().small_batch_format(req)
    assert small is not None and small.fmt.layout is Layout.STANDARD
    masked_fmt = dataclasses.replace(_fmt(QuantScheme.parse("bf16"), Layout.MASKED), row_alignment=MASKED_ROW_ALIGNMENT)
    ex = Nvfp4DequantRunner(req, masked_fmt, TorchGemmOps(False))
    ex.load(weights)
    token_disp = CudaPermuteDispatcher().build(req, small.fmt)
    masked_disp = CudaPermuteDispatcher().build(req, masked_fmt)
    rdisp = ReferenceDispatcher().build(req, small.fmt)
    rex = ReferenceExperts().build(req, small.fmt)
    rex.load(weights)
    for t in (1, 3, 2):
        x = torch.randn(t, 128, generator=g).bfloat16().to(DEV)
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(t)]).int()
        topk = TopK(ids.to(DEV), (torch.rand(t, cfg.top_k, generator=g) + 0.1).to(DEV))
        inp, handle = token_disp.dispatch(x, topk)
        buf = torch.full((t, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        out = ex.apply_into(inp, buf)
        assert out.hidden is buf and out.scaled, "the decode kernels write the caller's buffer, scaled"
        y = token_disp.combine(out, handle)
        minp, mhandle = masked_disp.dispatch(x, topk)
        ym = masked_disp.combine(ex.apply(minp), mhandle)
        rinp, rhandle = rdisp.dispatch(x, topk)
        ry = rdisp.combine(rex.apply(rinp), rhandle)
        # the masked path sums the same rounded rows in the same order
        assert _rel_max(y, ym) < (1e-6 if DEV == "cpu" else 4e-3), f"{t} tokens: token-major vs masked"
        # the reference layer's combine rounds its own way: a bf16 step of the output (5.3e-3 seen)
        assert _rel_max(y, ry) < 1e-2, f"{t} tokens: token-major vs the reference"
    assert ex._tokens is not None and len(ex._tokens._plans) == 3  # bound once per token count
    assert len(ex._input_quant) == 3  # and the input's quantizer
    ex.load(weights)
    assert ex._tokens is None and not ex._input_quant, "new weights: new global scales, bound again"


def test_launches_bound_per_batch_size_keep_the_recent_sizes_only():
    """The masked path binds its GEMMs and activation per row bound (one dict lookup a forward).
    A server's stream of prefill sizes brings a new bound at almost every call: the runner keeps
    the most recently used (`RecentBinds`), not every size it has seen."""
    from moehal.formats import MaskedInput
    from moehal.kernels.host import RecentBinds
    from moehal_cuda.deepgemm_experts import MASKED_ROW_ALIGNMENT

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    req = BuildRequest(cfg, QuantScheme.parse("bf16"), detect(DEV))
    fmt = ActivationFormat(Layout.MASKED, torch.bfloat16, ScaleKind.NONE, MASKED_ROW_ALIGNMENT)
    ex = DeepGemmExpertsRunner(req, fmt, _NoGemm(False))
    hidden = torch.zeros(4, MASKED_ROW_ALIGNMENT, 256, dtype=torch.bfloat16, device=DEV)
    masked_m = torch.zeros(4, dtype=torch.int32, device=DEV)
    for bound in [*range(1, 400), 7]:
        ex._masked_gemms(MaskedInput(hidden, None, masked_m, 1, bound))
    limit = RecentBinds().limit
    assert len(ex._masked) == limit == len(ex.masked_choices) and 7 in ex._masked and 399 in ex._masked
    assert 8 not in ex._masked  # the least recently used went first


def test_recent_binds_keep_the_most_recently_used():
    from moehal.kernels.host import RecentBinds

    kept = RecentBinds(3)
    for k in range(5):
        kept[k] = str(k)
    assert list(kept) == [2, 3, 4]
    assert kept.get(2) == "2" and kept.get(9) is None and list(kept) == [3, 4, 2]  # a hit is used again
    kept[5] = "5"
    assert list(kept) == [4, 2, 5]


def test_a_portable_runner_whose_build_raises_is_built_again_next_call(monkeypatch):
    """fp8_tensor's token-major batches run the portable fused MoE, built at the first such call.
    A build that raised midway (an OOM copying the per-expert scales) was kept without weights,
    and every later token-major batch failed; the engine's retry must find it built anew."""
    import moehal.kernels.triton_fused_moe as tfm

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, max_tokens=8)
    quant = QuantScheme.parse("fp8_tensor")
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(8, 256, 256, generator=g) / 16, torch.randn(8, 256, 128, generator=g) / 11
    weights = quantize_weights(cfg, quant, w13, w2, calibration_input=torch.randn(16, 256, generator=g)).to(DEV)
    req = BuildRequest(cfg, quant, detect(DEV))
    fmt = ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.STATIC_TENSOR, MASKED_ROW_ALIGNMENT)
    std = ActivationFormat(Layout.STANDARD, cfg.dtype)
    ex = DeepGemmExpertsRunner(req, fmt, TorchGemmOps(True), None, SmallBatchFormat(std, 2, ""))
    ex.load(weights)
    disp = CudaPermuteDispatcher().build(req, std)
    x = torch.randn(2, 256, generator=g).bfloat16().to(DEV)
    ids = torch.tensor([[0, 3], [5, 1]], dtype=torch.int32, device=DEV)
    topk = TopK(ids, (torch.rand(2, 2, generator=g) + 0.1).to(DEV))
    real = tfm.TritonMoEWeights

    def oom_once(*args, **kwargs):
        monkeypatch.setattr(tfm, "TritonMoEWeights", real)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 B")

    monkeypatch.setattr(tfm, "TritonMoEWeights", oom_once)
    with pytest.raises(torch.OutOfMemoryError):
        ex.apply(disp.dispatch(x, topk)[0])
    inp, handle = disp.dispatch(x, topk)
    got = disp.combine(ex.apply(inp), handle)
    ref_disp = ReferenceDispatcher().build(req, ReferenceExperts().input_formats(req)[0])
    ref_ex = ReferenceExperts().build(req, ReferenceExperts().input_formats(req)[0])
    ref_ex.load(weights)
    rinp, rh = ref_disp.dispatch(x, topk)
    want = ref_disp.combine(ref_ex.apply(rinp), rh)
    assert torch.isfinite(got).all() and ((got.float() - want.float()).norm() / want.float().norm()) < 0.05
