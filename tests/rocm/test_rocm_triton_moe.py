"""The ROCm backend's Triton path against the reference backend (same canonical weights).

CI runs this under TRITON_INTERPRET=1 (the Triton interpreter on CPU): real kernel code, small
shapes. On a GPU it runs compiled.
"""

from __future__ import annotations

import moehal
import pytest
import torch
from _rocm_testing import DEVICE, INTERPRET, TOL, TOL_DTYPE, needs_triton, problem, rel_err, triton_registry
from moehal.formats import ActivationFormat, Layout, ScaleKind, StandardInput
from moehal.hardware import HardwareInfo
from moehal.interfaces import BuildRequest
from moehal.quant.activation import quantize_activation
from moehal.reference.oracle import reference_layer

pytestmark = needs_triton


def run_pair(cfg: moehal.MoEConfig, quant: str, t: int, seed: int = 0):
    w, x, ids, wts = problem(cfg, quant, t, seed)
    reg = triton_registry()
    ours = moehal.MoELayer(cfg, quant, backend="tritonmoe", device=DEVICE, registry=reg)
    ref = reference_layer(cfg, quant, DEVICE, registry=reg)
    assert ours.plan.pipeline.main.name == "triton", ours.plan
    if INTERPRET:
        assert ours.plan.pipeline.execution_mode(ours.request) == "interpreted"
    ours.load_weights(w)
    ref.load_weights(w)
    return ours(x, ids, wts), ref(x, ids, wts), ours


SCHEMES = ["bf16", "fp8_block", "fp8_block:ue8m0", "fp8_tensor", "w8a8_int8"]
ACTS = [
    dict(activation="silu"),
    dict(activation="gelu", gated=False, has_w13_bias=True, has_w2_bias=True),
    dict(activation="swiglu_oai", has_w13_bias=True, has_w2_bias=True),
]


@pytest.mark.parametrize("quant", SCHEMES)
@pytest.mark.parametrize("act", ACTS, ids=["silu", "gelu_nongated_bias", "swiglu_oai_bias"])
def test_schemes_and_activations(quant, act):
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=96, **act)
    out, ref, _ = run_pair(cfg, quant, t=7)
    assert rel_err(out, ref) < TOL[quant]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_layer_dtypes(dtype):
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, dtype=dtype)
    out, ref, _ = run_pair(cfg, "bf16", t=5)
    assert rel_err(out, ref) < TOL_DTYPE[dtype]


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "fp8_tensor", "w8a8_int8"])
def test_expert_parallel_local_slice(quant):
    # rank 1 of 2 owns experts 4..7; slots routed to 0..3 contribute nothing here
    cfg = moehal.MoEConfig(num_experts=8, top_k=3, hidden_size=64, intermediate_size=128, ep_size=2, ep_rank=1)
    out, ref, _ = run_pair(cfg, quant, t=9, seed=3)
    assert rel_err(out, ref) < TOL[quant]


@pytest.mark.parametrize("act", ACTS, ids=["silu", "gelu_nongated_bias", "swiglu_oai_bias"])
def test_fp8_tensor_quantizes_as_the_reference_does(act):
    """In an fp32 layer only the fp32 sums' order separates the kernel from the oracle, so an
    fp8 value quantized differently (GEMM1's input, or the activation that GEMM1's epilogue
    quantizes for GEMM2 with the static scale) shows as an error of about 1e-3 to 1e-2 of the
    output's largest value. The sums' order itself can move a value that lies within an fp32 ulp
    of an fp8 rounding boundary; for a value near zero that step is tiny. On one AMD EPYC host
    (session 48, also at the session's first commit) a single such step of token 1's activation
    moved its row by 6.5e-5 (1.7e-5 of the largest output), where numpy's BLAS in the interpreter
    and torch's CPU matmul add in different orders: the bound is 1e-4, above that and below any
    value of consequence quantized differently. On a GPU the fp8 tensor-core dot accumulates with
    fewer bits than fp32 (about 14 on Hopper), so the bound there is looser but still below one
    flipped value."""
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=96, dtype=torch.float32, **act)
    out, ref, layer = run_pair(cfg, "fp8_tensor", t=7)
    assert rel_err(out, ref) < (1e-4 if INTERPRET else 2e-3)


def test_token_with_no_local_expert_is_zero():
    cfg = moehal.MoEConfig(num_experts=4, top_k=1, hidden_size=64, intermediate_size=64, ep_size=2, ep_rank=0)
    w, x, _, wts = problem(cfg, "bf16", t=3)
    ids = torch.tensor([[0], [3], [1]], dtype=torch.int32, device=DEVICE)  # token 1 goes to rank 1
    layer = moehal.MoELayer(cfg, "bf16", backend="tritonmoe", device=DEVICE, registry=triton_registry())
    layer.load_weights(w)
    out = layer(x, ids, wts)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_padded_slot_on_one_device_is_zero(top_k):
    """`topk_padding` on one device: a token whose every slot is -1 gets a zero row. At top-1
    the kernel writes the output rows itself (every expert local), and nobody wrote a padded
    token's row: it kept whatever the output buffer held (session 40's audit)."""
    cfg = moehal.MoEConfig(num_experts=4, top_k=top_k, hidden_size=64, intermediate_size=64, topk_padding=True)
    w, x, ids, wts = problem(cfg, "bf16", t=3)
    ids = ids.clone()
    ids[1] = -1  # token 1: padding
    layer = moehal.MoELayer(cfg, "bf16", backend="tritonmoe", device=DEVICE, registry=triton_registry())
    layer.load_weights(w)
    for _ in range(3):  # fresh output buffers may hold anything
        out = layer(x, ids, wts)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0


@pytest.mark.parametrize("t", [0, 1])
def test_zero_and_one_token(t):
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
    out, ref, _ = run_pair(cfg, "bf16", t=t)
    assert out.shape == (t, 64)
    if t:
        assert rel_err(out, ref) < TOL["bf16"]


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_top_k(top_k):
    cfg = moehal.MoEConfig(num_experts=4, top_k=top_k, hidden_size=64, intermediate_size=64)
    out, ref, _ = run_pair(cfg, "bf16", t=6, seed=top_k)
    assert rel_err(out, ref) < TOL["bf16"]


def test_router_weight_on_input():
    cfg = moehal.MoEConfig(
        num_experts=4, top_k=1, hidden_size=64, intermediate_size=64, apply_router_weight_on_input=True
    )
    out, ref, _ = run_pair(cfg, "bf16", t=5)
    assert rel_err(out, ref) < TOL["bf16"]


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_tensor"])
def test_plan_through_rocm_backend_is_interpreted_triton(quant):
    if not INTERPRET:
        pytest.skip("checks the CPU-interpreter plan of backend='rocm'")
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
    layer = moehal.MoELayer(cfg, quant, backend="rocm", device="cpu")
    assert layer.plan.pipeline.main.qualname == "rocm.triton"
    assert "INTERPRETED" in str(layer.plan)
    assert layer.plan.pipeline.processor is not None and layer.plan.pipeline.processor.qualname == "rocm.triton_weights"


# --- pre-quantized dispatch and the MI300 (e4m3fnuz) path, driven directly -----------------------


def _direct(cfg, quant, hw: HardwareInfo, fmt: ActivationFormat, t: int = 6):
    from moehal.kernels.triton_experts import TritonExperts, TritonWeightProcessor

    req = BuildRequest(cfg, moehal.QuantScheme.parse(quant), hw)
    w, x, ids, wts = problem(cfg, quant, t)
    processed = TritonWeightProcessor().process(w, req)
    runner = TritonExperts().build(req, fmt)
    runner.load(processed)
    q, s = quantize_activation(x, fmt.scales)
    out = runner.apply(StandardInput(q, s, ids, wts)).hidden
    ref = reference_layer(cfg, quant, DEVICE)
    ref.load_weights(w)
    return out, ref(x, ids, wts), processed


@pytest.mark.parametrize(
    "quant,fmt",
    [
        ("fp8_block", ActivationFormat(Layout.STANDARD, torch.float8_e4m3fn, ScaleKind.GROUP_128)),
        ("w8a8_int8", ActivationFormat(Layout.STANDARD, torch.int8, ScaleKind.PER_TOKEN)),
    ],
)
def test_prequantized_dispatch(quant, fmt):
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    out, ref, _ = _direct(cfg, quant, moehal.detect(DEVICE), fmt)
    assert rel_err(out, ref) < TOL[quant]


@pytest.mark.parametrize("quant,prequantized", [("fp8_block", False), ("fp8_block", True), ("fp8_tensor", False)])
def test_mi300_fnuz_path(quant, prequantized):
    """gfx942 computes in e4m3fnuz: the weight processor converts (bits kept, scale x2; per-tensor
    fp8's static activation scales x2 too) and the quantizers use max 224, which reproduces
    the e4m3fn reference grid exactly."""
    if not INTERPRET:
        pytest.skip("emulates MI300 hardware info on CPU tensors: interpreter only")
    dtype = torch.float32 if quant == "fp8_tensor" else torch.bfloat16  # fp32: exactness shows
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype=dtype)
    hw = HardwareInfo("rocm", torch.device("cpu"), "AMD Instinct MI300X (emulated info)", (9, 4), "gfx942")
    if prequantized:
        fmt = ActivationFormat(Layout.STANDARD, torch.float8_e4m3fn, ScaleKind.GROUP_128)
    else:
        fmt = ActivationFormat(Layout.STANDARD, dtype)
    out, ref, processed = _direct(cfg, quant, hw, fmt)
    assert processed.w13.dtype == torch.float8_e4m3fnuz
    assert rel_err(out, ref) < (1e-5 if quant == "fp8_tensor" else TOL[quant])


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "fp8_tensor", "w8a8_int8"])
def test_hidden_states_of_any_column_stride(quant):
    # the kernels index a row's columns densely: a column-major input (same values) must give
    # the same output, not rows read at the wrong addresses (the quantizers took stride(0) only)
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float32)
    w, x, ids, wts = problem(cfg, quant, 6)
    layer = moehal.MoELayer(cfg, quant, backend="tritonmoe", device=DEVICE, registry=triton_registry())
    layer.load_weights(w)
    column_major = x.t().contiguous().t()
    assert torch.equal(column_major, x) and column_major.stride(-1) != 1
    torch.testing.assert_close(layer(column_major, ids, wts), layer(x, ids, wts), rtol=0, atol=0)


def test_interpreted_kernels_are_reported_on_a_gpu_too():
    # TRITON_INTERPRET on a GPU host interprets moehal's kernels there as well: the mode says so,
    # and the plan does not claim graph capture for code the interpreter runs on the host
    if not INTERPRET:
        pytest.skip("checks what TRITON_INTERPRET=1 reports")
    from moehal.kernels.triton_experts import TritonExperts
    from moehal_cuda.dispatch import CudaPermuteDispatcher

    hw = HardwareInfo("cuda", torch.device("cuda", 0), "NVIDIA H200", (9, 0))
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    req = BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), hw)
    assert TritonExperts(devices=frozenset({"cuda"})).execution_mode(req) == "interpreted"
    assert CudaPermuteDispatcher().execution_mode(req) == "interpreted"


def test_fused_moe_on_quantized_input_needs_an_output_dtype():
    from moehal.kernels.triton_fused_moe import fused_moe

    x = torch.zeros(2, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs out_dtype"):
        fused_moe(x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), None, hidden_scales=torch.ones(2, 1))


def test_fused_moe_refuses_weights_of_another_shape_than_the_ids():
    """A `[T, 2K]` weights tensor (a caller's fused buffer) used to be flattened and read as
    if it were `[T, K]`: the wrong weight for every slot but the first row's, and no error."""
    from moehal.kernels import triton_fused_moe as k

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float32)
    w, x, ids, wts = problem(cfg, "bf16", 6)
    tw = k.TritonMoEWeights(w.w13.to(DEVICE), w.w2.to(DEVICE), "none")
    wide = torch.cat([wts, torch.zeros_like(wts)], 1)
    with pytest.raises(ValueError, match=r"with weights \[6, 4\]"):
        k.fused_moe(x.to(DEVICE), ids.to(DEVICE), wide.to(DEVICE), tw)


@pytest.mark.parametrize("block_k", [128, 64, 32])
def test_fp8_block_tiles_narrower_than_a_scale_group_read_the_right_scales(block_k):
    """`_fit` accepts fp8 K tiles of 32 and 64 (tuned tables, SGLang's configs use them): each K
    tile must read the scale of the 128-wide group it lies in. Every shipped tile is 128 wide,
    where a tile's index and its group's agree, so session 45's mutation audit found a kernel
    reading the tile index in place of the group passing every other test."""
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tiles import TileConfig
    from moehal.weights import quantize_weights

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 256, 256, generator=gen) / 16
    w2 = torch.randn(4, 256, 128, generator=gen) / 128**0.5
    w = quantize_weights(cfg, "fp8_block", w13, w2)
    # scales that differ along K, as checkpoints' do: a wrong group's scale shows
    w = w.replace(w13_scale=w.w13_scale * torch.tensor([1.0, 4.0]).view(1, 1, 2))
    x = torch.randn(5, 256, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
    wts = torch.rand(5, 2, generator=gen) + 0.1
    ref = reference_layer(cfg, "fp8_block", "cpu", layout="standard", validate=False)
    ref.load_weights(w)
    want = ref(x, ids, wts)
    d = DEVICE
    s13, s2 = w.w13_scale.float().to(d).contiguous(), w.w2_scale.float().to(d).contiguous()
    tw = k.TritonMoEWeights(w.w13.to(d).contiguous(), w.w2.to(d).contiguous(), "fp8_block", s13, s2)
    tile = TileConfig(16, 64, block_k, 1, 4, 1)
    got = k.fused_moe(x.to(d), ids.to(d), wts.to(d), tw, configs=(tile, tile), all_local=True).cpu()
    assert rel_err(got, want) < TOL["fp8_block"], rel_err(got, want)


def test_a_plan_not_run_natively_is_logged_as_a_warning(monkeypatch, caplog):
    """Interpreted or emulated kernels are a test mode: a leaked TRITON_INTERPRET in a server
    would run every layer on the host, slowly. The plan's log line says so at WARNING."""
    import logging

    from moehal import layer as layer_mod

    monkeypatch.setattr(layer_mod, "_LOGGED_PLANS", set())
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="moehal.layer"):
        layer = moehal.MoELayer(cfg, "bf16", backend="tritonmoe", device=DEVICE, registry=triton_registry())
    mode = layer.plan.pipeline.execution_mode(layer.request)
    (record,) = [r for r in caplog.records if r.name == "moehal.layer"]
    assert f"({mode})" in record.message and "tritonmoe" in record.message
    assert record.levelno == (logging.INFO if mode == "native" else logging.WARNING)
    if INTERPRET:
        assert mode == "interpreted" and "mode=interpreted" in repr(layer)
