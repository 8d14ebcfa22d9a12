"""Each emulated vendor op against an independent float64 computation of its documented semantics."""

from __future__ import annotations

import pytest
import torch
from moehal_npu import emulation
from moehal_npu.weights import float_bits_as_int64, permute_w13_columns


def _groups(counts: list[int]) -> list[tuple[int, int]]:
    out, s = [], 0
    for c in counts:
        out.append((s, s + c))
        s += c
    return out


COUNTS = [3, 0, 5, 2]  # an empty group in the middle; 2 padding rows after the last group


def _rows(m: int = 12, k: int = 16, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_bf16_both_group_list_conventions(group_list_type):
    gen = torch.Generator().manual_seed(1)
    x, w = _rows(), torch.randn(4, 16, 8, generator=gen).to(torch.bfloat16)
    counts = torch.tensor(COUNTS)
    gl = torch.cumsum(counts, 0) if group_list_type == 0 else counts
    (y,) = emulation.npu_grouped_matmul([x], [w], group_list=gl, group_list_type=group_list_type)
    assert y.dtype == torch.bfloat16 and y.shape == (12, 8)
    for g, (s, e) in enumerate(_groups(COUNTS)):
        ref = x[s:e].double() @ w[g].double()
        torch.testing.assert_close(y[s:e].double(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(y[sum(COUNTS) :], torch.zeros(2, 8, dtype=torch.bfloat16))


def test_grouped_matmul_int8_scales_and_raw_accumulator():
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-127, 128, (12, 64), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (4, 64, 8), generator=gen, dtype=torch.int8)
    # a bf16 output takes a bf16 weight scale on Atlas A2/A3 (the op's dtype table)
    scale, pts = (torch.rand(4, 8, generator=gen) + 0.5).bfloat16(), torch.rand(12, generator=gen) + 0.5
    gl = torch.tensor(COUNTS)
    (acc,) = emulation.npu_grouped_matmul([x], [w], group_list=gl, group_list_type=1, output_dtype=torch.int32)
    (y,) = emulation.npu_grouped_matmul(
        [x], [w], scale=[scale], per_token_scale=[pts], group_list=gl, group_list_type=1, output_dtype=torch.bfloat16
    )
    assert acc.dtype == torch.int32 and y.dtype == torch.bfloat16
    for g, (s, e) in enumerate(_groups(COUNTS)):
        exact = x[s:e].long() @ w[g].long()  # integer arithmetic, independent of the float path
        assert torch.equal(acc[s:e].long(), exact)
        ref = exact.double() * scale[g].double() * pts[s:e].double()[:, None]
        torch.testing.assert_close(y[s:e].double(), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError):
        emulation.npu_grouped_matmul([x], [w], group_list=gl, group_list_type=1, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes a torch.bfloat16 weight scale"):  # fp32 with bf16: 910_95 only
        emulation.npu_grouped_matmul(
            [x], [w], scale=[scale.float()], per_token_scale=[pts], group_list=gl, group_list_type=1,
            output_dtype=torch.bfloat16,
        )  # fmt: skip


def test_swiglu_is_silu_of_first_half_times_second():
    x = _rows(6, 10, seed=3)
    a, b = x.double()[:, :5], x.double()[:, 5:]
    ref = a / (1 + torch.exp(-a)) * b
    y = emulation.npu_swiglu(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("activate_left", [True, False])
def test_dequant_swiglu_quant(activate_left):
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(
        -(2**20), 2**20, (12, 128), generator=gen, dtype=torch.int32
    )  # output 64 wide: the op's alignment
    ws = torch.rand(4, 128, generator=gen) * 1e-3
    acts = torch.rand(12, generator=gen) * 1e-3
    q, s = emulation.npu_dequant_swiglu_quant(
        x,
        weight_scale=ws,
        activation_scale=acts,
        group_index=torch.tensor(COUNTS),
        activate_left=activate_left,
        quant_mode=1,
    )
    assert q.shape == (12, 64) and q.dtype == torch.int8
    for g, (st, en) in enumerate(_groups(COUNTS)):
        d = x[st:en].double() * ws[g].double() * acts[st:en].double()[:, None]
        left, right = d[:, :64], d[:, 64:]
        a = left / (1 + torch.exp(-left)) * right if activate_left else right / (1 + torch.exp(-right)) * left
        deq = q[st:en].double() * s[st:en].double()[:, None]
        bound = a.abs().amax(-1, keepdim=True) / 127 * 0.51 + 1e-9  # half a quantization step per row
        assert bool(((deq - a).abs() <= bound).all())
    assert torch.equal(q[sum(COUNTS) :], torch.zeros(2, 64, dtype=torch.int8))


@pytest.mark.parametrize("width", [32, 10560])
def test_dequant_swiglu_quant_refuses_what_the_op_checks(width):
    """With group_index, the op's output width must be <= 10496 and a multiple of 64 (its
    documented constraint, which it checks): the emulation refuses the same widths."""
    x = torch.zeros(4, 2 * width, dtype=torch.int32)
    with pytest.raises(ValueError, match="must be <= 10496 and a multiple of 64"):
        emulation.npu_dequant_swiglu_quant(
            x, weight_scale=torch.ones(1, 2 * width), activation_scale=torch.ones(4),
            group_index=torch.tensor([4]), activate_left=True, quant_mode=1,
        )  # fmt: skip


def test_format_cast_keeps_logical_values():
    w = _rows(4, 8, seed=6)
    assert torch.equal(emulation.npu_format_cast(w, 29), w)


def test_moe_init_routing_v2_refuses_cumulative_token_counts():
    """The kernel behind the op (aclnnMoeInitRoutingV3) takes counts (1) or key-value pairs (2),
    and refuses 0, the cumulative form, in its tiling check on Ascend 950 (Atlas A2/A3 take
    it); the emulation keeps the strictest chip's rule."""
    x, ids = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_tokens_num_type currently not support 0"):
        emulation.npu_moe_init_routing_v2(x, ids, expert_num=4, expert_tokens_num_type=0, expert_tokens_num_flag=True)


@pytest.mark.parametrize("quant_mode", [-1, 1])
@pytest.mark.parametrize("tokens_type", [1])
def test_moe_init_routing_v2(quant_mode, tokens_type):
    gen = torch.Generator().manual_seed(7)
    n, k, e, h = 9, 3, 8, 16
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).to(torch.int32)
    start, end = 2, 6
    ex, row_idx, tokens, scale = emulation.npu_moe_init_routing_v2(
        x,
        ids,
        active_num=n * k,
        expert_num=e,
        expert_tokens_num_type=tokens_type,
        expert_tokens_num_flag=True,
        quant_mode=quant_mode,
        active_expert_range=[start, end],
    )
    flat = ids.reshape(-1).long()
    kept = (flat >= start) & (flat < end)
    counts = torch.bincount(flat[kept] - start, minlength=end - start)
    assert torch.equal(tokens, counts)
    assert bool((row_idx[~kept] == -1).all())
    pos = row_idx[kept].long()
    assert sorted(pos.tolist()) == list(range(int(kept.sum())))  # a permutation onto the first rows
    # expert order: sorted, and stable (token-major) within an expert
    sorted_experts = torch.empty(int(kept.sum()), dtype=torch.long)
    sorted_experts[pos] = flat[kept]
    assert bool((sorted_experts[1:] >= sorted_experts[:-1]).all())
    slots = torch.nonzero(kept).flatten()
    for s in slots.tolist():
        src = x[s // k].double()
        row = ex[row_idx[s].long()]
        if quant_mode == 1:
            deq = row.double() * scale[row_idx[s].long()].double()
            assert float((deq - src).abs().max()) <= float(src.abs().max()) / 127 * 0.51 + 1e-6
        else:
            assert torch.equal(row, x[s // k])


def test_w13_tile_permute_matches_documented_index_map_and_inverse():
    n, tile = 512, 128
    cols = torch.arange(n).repeat(3, 1)  # [E, 2I] column ids
    p = permute_w13_columns(cols, tile)
    i = n // 2
    for new in range(n):
        c, rem = divmod(new, tile)
        s, r = divmod(rem, tile // 2)
        assert int(p[0, new]) == s * i + c * (tile // 2) + r
    assert torch.equal(emulation.unpermute_w13_columns(p, tile), cols)


def test_float_bits_as_int64_roundtrip():
    s = torch.rand(3, 5) + 0.01
    bits = float_bits_as_int64(s)
    assert bits.dtype == torch.int64
    assert torch.equal(bits.to(torch.int32).view(torch.float32), s)


def _fused_oracle(x, ids, wts, w13, s13, w2, s2, quantized):
    """Canonical weights (w13 [E,2I,H], w2 [E,H,I]) in float64."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for kk in range(ids.shape[1]):
            e = int(ids[t, kk])
            if e < 0:
                continue
            xi = x[t].double()
            if quantized:
                sc = xi.abs().max() / 127
                xi = torch.round(xi / sc).clamp(-127, 127) * sc
                h = (w13[e].double() * s13[e].double()[:, None]) @ xi
            else:
                h = w13[e].double() @ xi
            g, u = h.chunk(2)
            a = g / (1 + torch.exp(-g)) * u
            if quantized:
                sc = a.abs().max() / 127
                a = torch.round(a / sc).clamp(-127, 127) * sc
                y = (w2[e].double() * s2[e].double()[:, None]) @ a
            else:
                y = w2[e].double() @ a
            out[t] += float(wts[t, kk]) * y
    return out


def test_fused_deep_moe_takes_int8_weights_only():
    """FUSED_DEEP_MOE's op definition takes INT8 FRACTAL_NZ weights and fp32 scales; no vendor
    source shows a BF16 form, so the emulation refuses one rather than invent its math."""
    e, h, i = 2, 64, 128
    w13 = torch.zeros(e, h, 2 * i, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="INT8 weights"):
        emulation.fused_deep_moe(
            torch.zeros(1, h, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), w13,
            torch.ones(e, 2 * i), torch.zeros(e, h, i, dtype=torch.bfloat16), torch.ones(e, h), 1, e, quant_mode=0,
        )  # fmt: skip


@pytest.mark.parametrize(
    "fuse_mode,quantized", [(emulation.FUSED_DEEP_MOE, True), (emulation.DISPATCH_FFN_COMBINE, True)]
)
def test_fused_deep_moe(fuse_mode, quantized):
    gen = torch.Generator().manual_seed(8)
    e, h, i, bs, k = 3, 64, 128, 6, 2
    x = torch.randn(bs, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(bs)]).long()
    if fuse_mode == emulation.FUSED_DEEP_MOE:  # DISPATCH_FFN_COMBINE takes no -1 ids (the vendor's test of it)
        ids[0, 1] = -1  # a slot that is not dispatched
    wts = torch.rand(bs, k, generator=gen)
    if quantized:
        w13 = torch.randint(-127, 128, (e, 2 * i, h), generator=gen, dtype=torch.int8)
        w2 = torch.randint(-127, 128, (e, h, i), generator=gen, dtype=torch.int8)
        s13, s2 = torch.rand(e, 2 * i, generator=gen) * 1e-3, torch.rand(e, h, generator=gen) * 1e-3
    else:
        w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(torch.bfloat16)
        s13, s2 = torch.ones(e, 2 * i), torch.ones(e, h)
    g1, g2 = w13.transpose(1, 2), w2.transpose(1, 2)  # [E,H,2I], [E,I,H]
    if fuse_mode == emulation.FUSED_DEEP_MOE:  # gmm2 stays [E,H,I] (the vendor's doc, test and SGLang)
        g1, g1s, g2, g2s = permute_w13_columns(g1), permute_w13_columns(s13), w2, s2
    else:
        g1s, g2s = float_bits_as_int64(s13), float_bits_as_int64(s2)
    out, recv = emulation.fused_deep_moe(
        x, ids, wts, g1, g1s, g2, g2s, bs, e, quant_mode=1 if quantized else 0, fuse_mode=fuse_mode
    )
    ref = _fused_oracle(x, ids, wts, w13, s13, w2, s2, quantized)
    if fuse_mode == emulation.DISPATCH_FFN_COMBINE:
        dropped = ids.clone()
        dropped[0, 1] = -1
        with pytest.raises(ValueError, match="does not take -1 top-k ids"):
            emulation.fused_deep_moe(x, dropped, wts, g1, g1s, g2, g2s, bs, e, quant_mode=1, fuse_mode=fuse_mode)
    assert out.dtype == torch.bfloat16 and out.shape == (bs, h)
    assert torch.equal(recv, torch.bincount(ids[ids >= 0], minlength=e).to(torch.int32))
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < (0.065 if quantized else 2e-2), err


# --- operands the vendor ops refuse ------------------------------------------------------------


@pytest.mark.parametrize("arg", ["weight_scale", "activation_scale"])
def test_dequant_swiglu_quant_takes_float32_scales(arg):
    """ptaoplist_002367: weight_scale and activation_scale are float32 (e.g. a bf16 weight scale
    kept from the checkpoint is refused)."""
    kw = dict(weight_scale=torch.ones(1, 128), activation_scale=torch.ones(4))
    kw[arg] = kw[arg].to(torch.bfloat16)
    with pytest.raises(ValueError, match=f"npu_dequant_swiglu_quant: {arg} must be torch.float32.*got torch.bfloat16"):
        emulation.npu_dequant_swiglu_quant(
            torch.zeros(4, 128, dtype=torch.int32), group_index=torch.tensor([4]), activate_left=True, quant_mode=1,
            **kw,
        )  # fmt: skip


def test_moe_init_routing_v2_takes_int32_expert_idx():
    """ptaoplist_002366: expert_idx is int32 (top-k ids handed over uncast, int64, are refused)."""
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    kw = dict(expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    emulation.npu_moe_init_routing_v2(x, torch.zeros(2, 1, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: expert_idx must be torch.int32.*got torch.int64"):
        emulation.npu_moe_init_routing_v2(x, torch.zeros(2, 1, dtype=torch.int64), **kw)


def _fdm_operands(fuse_mode: int, bs: int = 4, e: int = 2, k: int = 2, h: int = 64, i: int = 128):
    x = torch.zeros(bs, h, dtype=torch.bfloat16)
    ids = torch.arange(bs * k).view(bs, k) % e
    w13 = torch.zeros(e, h, 2 * i, dtype=torch.int8)
    if fuse_mode == emulation.FUSED_DEEP_MOE:
        w2, s13, s2 = torch.zeros(e, h, i, dtype=torch.int8), torch.ones(e, 2 * i), torch.ones(e, h)
    else:
        w2 = torch.zeros(e, i, h, dtype=torch.int8)
        s13, s2 = float_bits_as_int64(torch.ones(e, 2 * i)), float_bits_as_int64(torch.ones(e, h))
    return x, ids, torch.ones(bs, k), w13, s13, w2, s2


@pytest.mark.parametrize(
    "arg,dtype,want",
    [("topk_idx", torch.int32, "torch.int64"), ("topk_weights", torch.bfloat16, "torch.float32")],
)
def test_fused_deep_moe_operand_dtypes(arg, dtype, want):
    """Buffer.fused_deep_moe's documented arguments: topk_idx int64, topk_weights float32."""
    x, ids, wts, w13, s13, w2, s2 = _fdm_operands(emulation.FUSED_DEEP_MOE)
    if arg == "topk_idx":
        ids = ids.to(dtype)
    else:
        wts = wts.to(dtype)
    with pytest.raises(ValueError, match=f"fused_deep_moe: {arg} must be {want}.*got {dtype}"):
        emulation.fused_deep_moe(x, ids, wts, w13, s13, w2, s2, 4, 2, quant_mode=1)


@pytest.mark.parametrize("fuse_mode", [emulation.FUSED_DEEP_MOE, emulation.DISPATCH_FFN_COMBINE])
def test_fused_deep_moe_checks_max_tokens_against_its_buffer(fuse_mode):
    """The low-latency buffer records the tokens per rank it was created for; fused_deep_moe
    takes that value (FUSED_DEEP_MOE) or the receive bound tokens * top_k * ranks
    (DISPATCH_FFN_COMBINE, as sgl-kernel-npu's test of the mode and moehal_npu pass it) and
    refuses the other mode's value."""
    max_tokens, e, k = 4, 2, 2
    buf = emulation.low_latency_buffer(None, max_tokens, 64, e, e)
    assert buf.num_max_dispatch_tokens_per_rank == max_tokens
    recv_bound = max_tokens * k * 1
    right, wrong = (max_tokens, recv_bound) if fuse_mode == emulation.FUSED_DEEP_MOE else (recv_bound, max_tokens)
    ops = _fdm_operands(fuse_mode, bs=max_tokens, e=e, k=k)
    emulation.fused_deep_moe(*ops, right, e, quant_mode=1, fuse_mode=fuse_mode, buffer=buf)
    with pytest.raises(ValueError, match=f"num_max_dispatch_tokens_per_rank={wrong}, but the low-latency buffer"):
        emulation.fused_deep_moe(*ops, wrong, e, quant_mode=1, fuse_mode=fuse_mode, buffer=buf)


def test_moe_distribute_combine_checks_ep_send_counts(world_of_one):
    """ptaoplist_002363: ep_send_counts is dispatch's ep_recv_counts handed back (int32, one
    entry per (local expert, EP rank)); tp_recv_counts, an int64 copy or other counts are refused."""
    gen = torch.Generator().manual_seed(9)
    bs, k, e, h = 5, 2, 4, 32
    x = torch.randn(bs, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(bs)]).to(torch.int32)
    wts = torch.rand(bs, k, generator=gen)
    expand_x, _, expand_idx, _, ep_recv, tp_recv, expand_scales = emulation.npu_moe_distribute_dispatch(
        x, ids, world_of_one, 1, 0, e, expert_scales=wts
    )
    assert ep_recv.dtype == torch.int32 and ep_recv.shape == (e,)

    def combine(counts):
        return emulation.npu_moe_distribute_combine(
            expand_x, ids, expand_idx, counts, wts, world_of_one, 1, 0, e, expand_scales=expand_scales
        )

    out = combine(ep_recv)
    ref = (x.float()[:, None, :] * wts[:, :, None]).sum(1)  # every expert the identity
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="ep_send_counts must be 1-D with .* 4 entries.*got shape \\(1,\\)"):
        combine(tp_recv)
    with pytest.raises(ValueError, match="ep_send_counts must be torch.int32.*got torch.int64"):
        combine(ep_recv.long())
    with pytest.raises(ValueError, match="ep_send_counts differs from the ep_recv_counts"):
        combine(ep_recv.flip(0) if not torch.equal(ep_recv.flip(0), ep_recv) else ep_recv + 1)
