"""moe_align_block_size invariants (property test), the Triton activation quantizers against the
reference quantizers, and the block-size config heuristic / tuned-table hook."""

from __future__ import annotations

import pytest
import torch
from _rocm_testing import DEVICE, needs_triton
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")


def _kernel():
    from moehal.kernels import triton_fused_moe

    return triton_fused_moe


@st.composite
def routing(draw):
    e = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(e, 4)))
    t = draw(st.integers(0, 12))
    block = draw(st.sampled_from([1, 2, 4, 16, 64]))
    local_lo = draw(st.integers(-2, 0))  # ids below 0 / at or above e play remote experts
    rows = [draw(st.permutations(list(range(local_lo, e + 2))))[:k] for _ in range(t)]
    ids = torch.tensor(rows, dtype=torch.int32).reshape(t, k)
    return ids, e, block


@needs_triton
@settings(max_examples=150, deadline=None)
@given(routing())
def test_align_invariants(case):
    ids, e, block = case
    k = _kernel()
    sorted_ids, expert_ids, num_post = (r.cpu() for r in k.moe_align_block_size(ids.to(DEVICE), block, e))
    t, top_k = ids.shape
    s = t * top_k
    length, nblocks = k.align_sizes(s, e, block)
    # static worst-case sizes
    assert sorted_ids.shape == (length,) and length == s + e * (block - 1)
    assert expert_ids.shape == (nblocks,)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    n = int(num_post[0])
    flat = ids.reshape(-1).long()
    local = (flat >= 0) & (flat < e)
    counts = torch.bincount(flat[local], minlength=e)
    # live prefix = sum of per-expert counts rounded up to the block
    assert n == int(((counts + block - 1) // block * block).sum()) and n % block == 0 and n <= length
    live = sorted_ids[:n].long()
    real = live[live < s]
    # every local slot exactly once, no remote slot, padding = s
    assert sorted(real.tolist()) == torch.nonzero(local).flatten().tolist()
    assert bool((live[live >= s] == s).all()) and bool((sorted_ids[n:] == s).all())
    # each block belongs to one expert; all its real slots are routed to that expert, in slot order
    for b in range(nblocks):
        ex = int(expert_ids[b])
        blk = sorted_ids[b * block : (b + 1) * block].long()
        if b * block >= n:
            assert ex == -1
            continue
        assert 0 <= ex < e
        r = blk[blk < s]
        assert bool((flat[r] == ex).all())
        assert r.tolist() == sorted(r.tolist())
    # experts appear in ascending order over the live blocks
    live_experts = expert_ids[: n // block].tolist()
    assert live_experts == sorted(live_experts)


@needs_triton
@settings(max_examples=80, deadline=None)
@given(routing())
def test_align_kernels_equal_the_torch_ops(case):
    """The Triton align (positions, then one placing kernel) against its torch-op reference,
    element for element: remote ids, empty experts, block 1, and zero tokens included."""
    ids, e, block = case
    k = _kernel()
    got = k.moe_align_block_size(ids.to(DEVICE), block, e)
    want = k.moe_align_block_size_torch(ids, block, e)
    for g, w, name in zip(got, want, ("sorted_ids", "expert_ids", "num_post")):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), name


@needs_triton
def test_align_kernels_at_prefill_size():
    """Several position chunks (a counts pass first) and 128 experts, as at Qwen3-30B-A3B prefill."""
    k = _kernel()
    gen = torch.Generator().manual_seed(3)
    ids = torch.rand(1024, 128, generator=gen).argsort(dim=1)[:, :8].to(torch.int32)
    ids[::7, 0] = -1  # a few remote slots
    for block in (16, 64, 128):
        got = k.moe_align_block_size(ids.to(DEVICE), block, 128)
        want = k.moe_align_block_size_torch(ids, block, 128)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), block


@needs_triton
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_group_quant_fp8_matches_reference(ue8m0, fp8_dtype):
    from moehal.quant import fp8

    if DEVICE != "cpu" and fp8_dtype == torch.float8_e4m3fnuz:
        pytest.skip("e4m3fnuz kernels compile only for ROCm gfx94x")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=gen) * torch.logspace(-6, 3, 300)
    x[0] = 0.0  # an all-zero row stays zero
    q, s = _kernel().per_token_group_quant_fp8(x.to(DEVICE), fp8_dtype, ue8m0)
    qr, sr = fp8.quantize_group(x, ue8m0)
    ours = q.float().cpu() * s.cpu().repeat_interleave(128, dim=1)[:, :300]
    ref = qr.float() * sr.repeat_interleave(128, dim=1)[:, :300]
    # e4m3fnuz with max 224 is the e4m3fn grid scaled by 1/2: the dequantized values are identical.
    if fp8_dtype == torch.float8_e4m3fn:
        assert torch.equal(s.cpu(), sr), "scales must agree exactly"
    if DEVICE == "cpu":
        assert torch.equal(ours, ref)
    else:
        # Seen on an H100 (2026-11-22): Triton's fp32 division on GPUs is not IEEE-exact, so a
        # value at a rounding boundary can land one e4m3 step (1/8 relative) from torch's.
        step = (ref.abs() / 8).clamp_min(s.cpu().repeat_interleave(128, dim=1)[:, :300] * 2**-9)
        assert ((ours - ref).abs() <= step).all()
        assert (ours != ref).float().mean() < 0.01, "more than rare boundary cases differ"
    assert torch.equal(ours[0], torch.zeros(300))


@needs_triton
def test_token_quant_int8_matches_reference():
    from moehal.quant import int8

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 200, generator=gen) * 3
    x[2, :] = 0.0
    x[3, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0])  # ties round to even, like torch.round
    q, s = _kernel().per_token_quant_int8(x.to(DEVICE))
    qr, sr = int8.quantize_per_token(x)
    assert torch.equal(q.cpu(), qr)
    assert torch.allclose(s.cpu(), sr, rtol=1e-6, atol=0)


@needs_triton
@pytest.mark.parametrize("quantizer", ["fp8_group", "int8"])
def test_quantizers_called_directly_read_any_column_stride(quantizer):
    """The kernels step a row's columns by 1: a column-major input (the same values) must give
    the same bits, not values read at other addresses (found by a memory-layout review: the
    wrappers passed stride(0) only, and `fused_moe`'s fp8 and int8 schemes went 3.1 off)."""
    k = _kernel()
    quantize = k.per_token_group_quant_fp8 if quantizer == "fp8_group" else k.per_token_quant_int8
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    column_major = x.t().contiguous().t()
    assert torch.equal(column_major, x) and column_major.stride(-1) != 1
    (q, s), (qc, sc) = quantize(x), quantize(column_major)
    assert torch.equal(qc.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc, s)


@pytest.mark.parametrize("m", [1, 8, 64, 512, 8192])
@pytest.mark.parametrize("quant", ["none", "fp8_block", "int8"])
def test_heuristic_configs_respect_kernel_constraints(m, quant):
    k = _kernel()
    g1, g2 = k.select_configs(m, 8, 4096, 1408, 6, quant, "bf16", None, is_rocm=True)
    assert g1.block_m == g2.block_m  # one alignment for both GEMMs
    for g in (g1, g2):
        assert g.block_m in (16, 32, 64, 128) and g.block_n >= 16 and g.block_k >= 16  # tl.dot minimums
        assert g.num_warps in (1, 2, 4, 8, 16) and g.num_stages >= 1
        if quant == "fp8_block":
            assert 128 % g.block_k == 0  # a K tile never straddles two scale groups


def test_tuned_table_hook_takes_precedence():
    k = _kernel()
    tuned = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4, "num_warps": 2}
    key = k.table_key(8, 512, 256, "bf16")
    k.register_tuned_configs("Test GPU (moehal) X1", {key: {"16": {"gemm1": tuned}, "1024": {"gemm1": tuned}}})
    g1, g2 = k.select_configs(20, 8, 512, 256, 2, "none", "bf16", "Test GPU (moehal) X1")
    assert (g1.block_m, g1.block_n, g1.block_k, g1.group_m, g1.num_warps) == (32, 32, 64, 4, 2)
    assert g2.block_m == 32
    other = k.select_configs(20, 8, 512, 256, 2, "none", "bf16", "Another GPU")
    assert other[0] == k.select_configs(20, 8, 512, 256, 2, "none", "bf16", None)[0]
