"""Quantization is bitwise the same on every device: the reference's quantizers on the GPU give the
CPU's bits, and the Triton quantizers (the portable fused MoE's, the quantizing permute's, the
NVFP4 glue's) give the reference's.

Inputs are bf16 with ties planted: in half the groups the amax is 1.75 * 2^k, so amax / 448 is a
power of two, every quotient x / scale is exact, and about one value in sixteen lies exactly on a
tie of the e4m3 grid. A quotient or a scale one ulp off (a multiply by the reciprocal, Triton's
approximate `/`) rounds such a tie the other way. Session 48 traced the open failure of session
47's GPU fuzz to exactly this, in the oracle (torch on CUDA divides by a Python number as a
multiply) and in the kernels (docs/device-runs/2026-11-28-session48). On the CPU the Triton
kernels run interpreted; the reference's CPU bits are the ones every device must give.
"""

from __future__ import annotations

import pytest
import torch
from moehal.kernels.host import interpreting
from moehal.quant import fp8, int8, nvfp4

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tied_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 `[rows, cols]` whose 128-wide groups alternate: a random amax, or an amax of
    1.75 * 2^k (amax / 448 = 2^(k-8) exactly, so quotients are exact and ties are common)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).bfloat16()
    groups = x.view(rows, -1, 128)
    tied = groups[:, ::2]
    k = torch.randint(-3, 3, (rows, tied.shape[1]), generator=g).float()
    amax = (1.75 * torch.exp2(k)).bfloat16()
    # the largest entry of each tied group becomes exactly amax; the rest stay below it
    tied.copy_((tied.float() / tied.float().abs().amax(-1, keepdim=True) * amax[..., None].float() * 0.99).bfloat16())
    tied[..., 0] = amax
    return x


try:  # a kernel of `e4m3_scaled` alone (Triton resolves a kernel's callees among its globals)
    import triton
    import triton.language as tl
    from moehal.kernels.triton_permute import e4m3_scaled

    @triton.jit
    def _scaled(v_ptr, s_ptr, q_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(q_ptr + offs, e4m3_scaled(tl.load(v_ptr + offs), tl.load(s_ptr + offs), False))

except ImportError:
    _scaled = None

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="compares a GPU's bits with the CPU's")
runs_triton = pytest.mark.skipif(
    _scaled is None or (DEV.type == "cpu" and not interpreting()),
    reason="Triton needs a GPU, or TRITON_INTERPRET=1 on a CPU",
)


def test_planted_ties_move_with_one_ulp_of_scale():
    """The inputs do what the tests below need: a scale one ulp larger, as a multiply by the
    reciprocal gives at times, moves many of their values to the other e4m3 neighbour."""
    x = tied_rows(64, 2048, 0).float()
    q, s = fp8.quantize_group(x)
    nudged = (x.view(64, -1, 128) / torch.nextafter(s, s * 2)[..., None]).clamp(-448, 448)
    moved = nudged.reshape(64, -1).to(torch.float8_e4m3fn).view(torch.uint8) != q.view(torch.uint8)
    assert int(moved.sum()) > 100, int(moved.sum())


@pytest.mark.parametrize("divisor", [448.0, 127.0, 6.0, 7.0])
def test_ieee_div_is_the_correctly_rounded_quotient(divisor):
    """`moehal.quant.ieee.div` on this device: the float64 quotient rounded once to float32
    (a float64 quotient of two float32 values rounds to float32 as the exact one would)."""
    from moehal.quant.ieee import div

    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(5)) * 1000
    want = (x.double() / divisor).float()
    assert torch.equal(div(x.to(DEV), divisor).cpu(), want)


@on_gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_fp8_groups_are_the_cpu_bits(seed):
    x = tied_rows(64, 2048, seed)
    _assert_same_fp8(fp8.quantize_group(x.to(DEV).float()), fp8.quantize_group(x.float()), "1x128 groups")
    w = x.float().view(2, 256, 256)  # two experts' weights, 2x2 blocks of 128x128 each
    _assert_same_fp8(fp8.quantize_block(w.to(DEV)), fp8.quantize_block(w), "128x128 blocks")


def _assert_same_fp8(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    (q, s), (q_ref, s_ref) = got, want
    s, q = s.cpu(), q.cpu().view(torch.uint8)
    assert torch.equal(s, s_ref), f"{what}: {int((s != s_ref).sum())} of {s.numel()} scales differ"
    bad = q != q_ref.view(torch.uint8)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {q.numel()} values differ, e.g. {q[bad][:4].tolist()} for "
        f"{q_ref.view(torch.uint8)[bad][:4].tolist()}"
    )


@on_gpu
def test_reference_int8_and_nvfp4_are_the_cpu_bits():
    x = tied_rows(32, 1024, 2).float()
    for fn in (int8.quantize_per_token, int8.quantize_per_channel):
        q_cpu, s_cpu = fn(x)
        q_dev, s_dev = fn(x.to(DEV))
        assert torch.equal(q_dev.cpu(), q_cpu) and torch.equal(s_dev.cpu(), s_cpu), fn.__name__
    gs = nvfp4.global_scale_for(x)
    p_cpu, sf_cpu = nvfp4.quantize(x, gs)
    p_dev, sf_dev = nvfp4.quantize(x.to(DEV), gs.to(DEV))
    assert torch.equal(p_dev.cpu(), p_cpu) and torch.equal(sf_dev.cpu().view(torch.uint8), sf_cpu.view(torch.uint8))


@runs_triton
@pytest.mark.parametrize("ue8m0", [False, True])
def test_portable_quantizers_give_the_reference_bits(ue8m0):
    """`per_token_group_quant_fp8` (the portable fused MoE's input and intermediate quantizer)
    and `per_token_quant_int8`, against the reference's CPU bits."""
    from moehal.kernels.triton_fused_moe import per_token_group_quant_fp8, per_token_quant_int8

    x = tied_rows(16, 512, 3)
    q, s = per_token_group_quant_fp8(x.to(DEV), ue8m0=ue8m0)
    q_ref, s_ref = fp8.quantize_group(x.float(), ue8m0=ue8m0)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    qi, si = per_token_quant_int8(x.to(DEV))
    qi_ref, si_ref = int8.quantize_per_token(x.float())
    assert torch.equal(si.cpu(), si_ref) and torch.equal(qi.cpu(), qi_ref)


@runs_triton
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_glue_quantizes_to_the_reference_bits(ue8m0):
    """The DeepGEMM experts' activation glue (SiLU-and-mul, then GEMM2's input in 1x128 groups:
    `e4m3_scaled`'s reciprocal and remainder step on the GPU) gives the reference's bits on an
    activation with planted ties: gate 32 (SiLU(32) is 32 in fp32), up = the tied rows / 32, so
    the activation is the tied rows exactly."""
    import moehal
    import moehal_cuda.triton_glue as glue
    from moehal.kernels import triton_permute as TP

    e, m, i = 2, 16, 512
    act = tied_rows(e * m, i, 4)
    h = torch.cat([torch.full_like(act, 32.0), (act.float() / 32).bfloat16()], dim=-1).view(e, m, 2 * i).to(DEV)
    out = TP.alloc_padded((e, m), i, torch.float8_e4m3fn, DEV, True)
    y = torch.zeros(e, m, 128, dtype=torch.bfloat16, device=DEV)
    rows = glue.RowIndex(e * m, m, masked_m=torch.full((e,), m, dtype=torch.int32, device=DEV))
    cfg = moehal.MoEConfig(num_experts=e, top_k=1, hidden_size=128, intermediate_size=i)
    glue.activation(h, out, y, rows, cfg, ue8m0=ue8m0)
    q_ref, s_ref = fp8.quantize_group(act.float(), ue8m0=ue8m0)
    assert torch.equal(out.scales.reshape(e * m, -1).cpu(), s_ref)
    q = out.hidden.reshape(e * m, i).cpu().view(torch.uint8)
    assert torch.equal(q, q_ref.view(torch.uint8)), f"{int((q != q_ref.view(torch.uint8)).sum())} values differ"


@runs_triton
def test_reciprocal_and_remainder_step_is_the_ieee_quotient():
    """`e4m3_scaled`'s GPU form (the scale's correctly rounded reciprocal, then one remainder
    step in two FMAs), run as a kernel of its own: the IEEE quotient for random values and
    scales, and for the planted ties' exact ones. On a GPU a plain multiply by the reciprocal
    differs in about a quarter of these. The interpreter computes such float32 arithmetic in
    float64 and rounds once, so on a CPU this checks the formula, not the rounding."""
    g = torch.Generator().manual_seed(6)
    n = 1 << 14
    v = torch.cat([torch.randn(n, generator=g) * 100, tied_rows(n // 2048, 2048, 7).float().reshape(-1)])
    tied_scales = fp8.quantize_group(v[n:].view(-1, 128))[1].repeat_interleave(128)
    sc = torch.cat([torch.rand(n, generator=g) + 1e-3, tied_scales])
    q = torch.empty_like(v, device=DEV)
    _scaled[(v.numel() // 1024,)](v.to(DEV), sc.to(DEV), q, BLOCK=1024)
    assert torch.equal(q.cpu(), v / sc), f"{int((q.cpu() != v / sc).sum())} quotients differ"
