"""Reference quantization: round trips, scale formats, packing, documented error bounds."""

from __future__ import annotations

import moehal
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from moehal.kernels.triton_permute import round_to_bf16_grid
from moehal.quant import QuantScheme, fp8, int8, nvfp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: interpreted on the CPU


@given(n=st.integers(1, 300), k=st.integers(1, 300), ue8m0=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_fp8_block_roundtrip_error_is_bounded(n, k, ue8m0, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 3
    q, s = fp8.quantize_block(w, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (fp8.num_blocks(n), fp8.num_blocks(k))
    err = (fp8.dequantize_block(q, s) - w).abs()
    # e4m3 has 3 mantissa bits: relative step 2^-3, so error <= half a step of the block max
    # (twice that with power-of-two scales, which leave up to one bit unused).
    bound = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] * fp8.FP8_MAX * (2**-4) * (2 if ue8m0 else 1)
    assert (err <= bound + 1e-6).all()
    if ue8m0:
        assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))


@given(t=st.integers(0, 20), k=st.integers(1, 400), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_fp8_group_and_int8_token_roundtrip(t, k, seed):
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    q, s = fp8.quantize_group(x)
    assert s.shape == (t, fp8.num_blocks(k))
    bound = s.repeat_interleave(128, -1)[:, :k] * fp8.FP8_MAX * 2**-4  # half an e4m3 step of the group max
    assert ((fp8.dequantize_group(q, s) - x).abs() <= bound + 1e-6).all()
    qi, si = int8.quantize_per_token(x)
    assert qi.dtype == torch.int8 and si.shape == (t,)
    if t:
        assert ((int8.dequantize_rows(qi, si) - x).abs() <= si[:, None] / 2 + 1e-6).all()


def test_zero_rows_stay_zero():
    x = torch.zeros(3, 256)
    assert (fp8.qdq_group(x) == 0).all() and (int8.qdq_per_token(x) == 0).all()
    assert (nvfp4.qdq(x, 1.0) == 0).all()


def test_e2m1_codes_cover_the_grid_and_round_to_nearest_even():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(nvfp4.decode_e2m1(nvfp4.encode_e2m1(grid)), grid)
    assert torch.equal(nvfp4.decode_e2m1(nvfp4.encode_e2m1(-grid[1:])), -grid[1:])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert nvfp4.decode_e2m1(nvfp4.encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert nvfp4.decode_e2m1(nvfp4.encode_e2m1(torch.tensor([100.0, -7.0]))).tolist() == [6.0, -6.0]


@given(rows=st.integers(1, 5), blocks=st.integers(1, 6), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_nvfp4_pack_unpack_and_error(rows, blocks, seed):
    x = torch.randn(rows, 16 * blocks, generator=torch.Generator().manual_seed(seed))
    codes = nvfp4.encode_e2m1(x)
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes)), codes)
    gs = nvfp4.global_scale_for(x)
    packed, sf = nvfp4.quantize(x, gs)
    assert packed.shape == (rows, 8 * blocks) and sf.shape == (rows, blocks) and sf.dtype == torch.float8_e4m3fn
    y = nvfp4.dequantize(packed, sf, gs)
    # the largest grid step is 2 (between 4 and 6): error <= 1 unit of the block scale,
    # plus e4m3 rounding of the block scale itself (<= 1/16 relative).
    unit = (sf.float() / gs).repeat_interleave(16, -1)
    assert ((y - x).abs() <= unit * 1.0 + x.abs() * 0.07 + 1e-6).all()


def test_nvfp4_low_nibble_holds_the_even_element():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert nvfp4.pack(codes).tolist() == [[0x21, 0x43]]


@pytest.mark.parametrize("text", ["bf16", "fp8_block", "fp8_block:ue8m0", "fp8_tensor", "nvfp4", "w8a8_int8"])
def test_scheme_names_round_trip(text):
    assert QuantScheme.parse(text).name == text


def test_unknown_scheme_and_bad_ue8m0_are_config_errors():
    with pytest.raises(moehal.ConfigError, match="known:"):
        QuantScheme.parse("int4")
    with pytest.raises(moehal.ConfigError, match="known:"):
        QuantScheme.parse("fp8_block:")  # a colon with no scale format after it
    with pytest.raises(moehal.ConfigError, match="fp8_block only"):
        QuantScheme.parse("nvfp4:ue8m0")


@pytest.mark.parametrize("quant", ["fp8_tensor", "nvfp4"])
def test_static_activation_scales_cover_the_w13_bias(quant):
    # the second GEMM's input is act(x @ w13^T + b13): a calibration without the bias clipped it
    cfg = moehal.MoEConfig(
        num_experts=2, top_k=1, hidden_size=32, intermediate_size=16, has_w13_bias=True, dtype=torch.float32
    )
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(2, 32, 32, generator=g) * 0.05, torch.randn(2, 32, 16, generator=g) * 0.05
    b13 = torch.full((2, 32), 8.0)  # the activation's range comes from the bias
    x = torch.randn(8, 32, generator=g)
    scheme = moehal.QuantScheme.parse(quant)
    assert scheme.static_activation_scales
    w = moehal.quantize_weights(cfg, scheme, w13, w2, w13_bias=b13, calibration_input=x)
    a2 = moehal.activations.apply_activation(torch.einsum("th,enh->etn", x, w13) + b13[:, None, :], cfg)
    full = 448.0 if quant == "fp8_tensor" else 448.0 * 6.0
    covered = full / float(w.a2_scale) if quant == "nvfp4" else float(w.a2_scale) * full
    assert covered >= float(a2.abs().amax())


@pytest.mark.parametrize("scale_of_amax", [1.0, 0.25])  # 0.25: a static scale that clips the tails
def test_fp8_tensor_qdq_divides_by_the_static_scale(scale_of_amax):
    """Per-tensor fp8: q = e4m3(clamp(x / s, +-448)), x' = q * s. Within range, the error is at
    most half an e4m3 step: 2^-4 relative for normals, 2^-10 * s absolute for subnormals."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    s = torch.tensor(float(x.abs().amax()) / fp8.FP8_MAX * scale_of_amax)
    got = fp8.qdq_tensor(x, s)
    want = (x / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(got, want)
    inside = x.abs() <= fp8.FP8_MAX * s
    assert ((got - x).abs()[inside] <= x.abs()[inside] * 2**-4 + s * 2**-10 + 1e-7).all()
    assert torch.equal(got[~inside], x[~inside].sign() * fp8.FP8_MAX * s)


def test_nvfp4_codes_use_the_e4m3_rounded_block_scale():
    """NVFP4 quantizes each block with the block scale it stores: sf = e4m3(amax / 6 * gs), then
    codes = e2m1(x * gs / float(sf)), as FlashInfer's fp4_quantize kernel does (TensorRT-LLM's
    quantization_utils.cuh: `SFValue = static_cast<float>(tmp)` before the output scale) and
    the Triton glue's nvfp4_qdq; not with the unrounded amax / 6 * gs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=g) * 3
    gs = nvfp4.global_scale_for(x) / 4  # block scales well inside e4m3's range, most of them inexact
    packed, sf = nvfp4.quantize(x, gs)
    blocks = x.reshape(8, 16, 16)
    assert torch.equal(sf, (blocks.abs().amax(-1) / 6 * gs).clamp(max=448).to(torch.float8_e4m3fn))
    want = nvfp4.encode_e2m1(blocks * (gs / sf.float())[..., None]).reshape(8, 256)
    assert torch.equal(nvfp4.unpack(packed), want)


def test_dequantize_weights_takes_a_scheme_or_its_name():
    """As `quantize_weights` does: a name raised AttributeError ('str' has no 'kind')."""
    from moehal.weights import dequantize_weights

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    g = torch.Generator().manual_seed(0)
    w = moehal.quantize_weights(
        cfg, "fp8_block", torch.randn(4, 256, 128, generator=g), torch.randn(4, 128, 128, generator=g)
    )
    by_name, by_scheme = dequantize_weights(w, "fp8_block"), dequantize_weights(w, QuantScheme.parse("fp8_block"))
    assert all(torch.equal(a, b) for a, b in zip(by_name, by_scheme))


def test_ue8m0_scales_round_up_from_the_bits_in_the_oracle_and_the_triton_quantizer():
    """UE8M0 scales are the smallest power of two >= amax / 448. `exp2(ceil(log2(s)))` kept 2^k
    for float32 scales up to ~16 ulp above 2^k (log2 rounds to exactly k there), so q could
    exceed 448 before its clamp. Both now take the exponent from the bits, as DeepEP's and
    SGLang's quantizers do, and agree bit for bit."""
    import numpy as np
    from moehal.kernels.triton_fused_moe import per_token_group_quant_fp8

    pows = torch.exp2(torch.arange(-40, 40, dtype=torch.float64)).float()
    above = torch.cat([(pows.view(torch.int32) + d).view(torch.float32) for d in (0, 1, 2, 7, 16, 17, 1000)])
    got = fp8.ceil_pow2(above)
    want = torch.tensor([2.0 ** np.ceil(np.log2(np.float64(v))) for v in above.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(fp8.ceil_pow2(torch.tensor([float("inf")])), torch.tensor([float("inf")]))
    # rows whose amax / 448 lands at 2^k and just above it, float32 input (bf16 cannot land there)
    amax = (above[: 80 * 4] * fp8.FP8_MAX).float()
    x = torch.zeros(amax.numel(), 128)
    x[:, 0], x[:, 1] = amax, -amax / 3
    q, s = fp8.quantize_group(x, ue8m0=True)
    exact = amax.double() / fp8.FP8_MAX
    assert (s[:, 0].double() >= exact).all() and (s[:, 0].double() < 2 * exact).all()
    tq, ts = per_token_group_quant_fp8(x.to(DEV), ue8m0=True)
    assert torch.equal(ts.cpu(), s) and torch.equal(tq.cpu().float(), q.float())


@triton.jit
def _bf16_rounded(x_ptr, o_ptr, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(o_ptr + i, round_to_bf16_grid(tl.load(x_ptr + i)))


def test_the_interpreters_bf16_rounding_keeps_nan_and_rounds_as_torch():
    """Under the Triton interpreter the kernels round fp32 to bf16 from the bits (its own cast
    truncates). A NaN whose payload fills the low half carried into the sign and came out as a
    zero, which hid a NaN leak from interpreted conformance."""
    nans = torch.tensor([0x7FC00000, 0x7FFF8000, 0x7FFFFFFF, -1, -4194304], dtype=torch.int32).view(torch.float32)
    finite = torch.randn(1015, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 38, 1015)
    x = torch.cat([nans, finite, torch.tensor([float("inf"), -float("inf"), 3.3e38, -0.0])])
    x = x.to(DEV)
    out = torch.empty_like(x)
    _bf16_rounded[(1,)](x, out, B=x.numel())
    x, out = x.cpu(), out.cpu()
    assert out[:5].isnan().all()
    assert torch.equal(out[5:], x[5:].bfloat16().float())
