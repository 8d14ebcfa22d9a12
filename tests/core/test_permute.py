"""Permute and combine round trips (hypothesis): every routed slot lands exactly once, in
its expert's segment, and combine of an identity expert gives back sum_k w_k * x."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moehal import permute
from moehal.formats import ContiguousInput


@st.composite
def routing(draw):
    e = draw(st.integers(1, 9))
    k = draw(st.integers(1, e))
    t = draw(st.integers(0, 12))
    ep_size = draw(st.sampled_from([d for d in (1, 2, 3) if e % d == 0]))
    rank = draw(st.integers(0, ep_size - 1))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    skew = draw(st.booleans())
    if skew and t and k == 1:
        ids = torch.zeros_like(ids)  # all tokens to one expert
    return ids.to(torch.int32), e, ep_size, rank, g


@given(routing(), st.integers(1, 8))
@settings(max_examples=80, deadline=None)
def test_masked_and_contiguous_round_trip(r, alignment):
    ids, e, ep_size, rank, g = r
    t, k = ids.shape
    e_local, start = e // ep_size, rank * (e // ep_size)
    x = torch.randn(t, 16, generator=g)
    w = torch.rand(t, k, generator=g)
    idx = permute.index_slots(ids, start, e_local)
    local = (ids >= start) & (ids < start + e_local)
    expected = (x[:, None, :] * (w * local)[..., None]).sum(1)
    # per-expert counts
    for j in range(e_local):
        assert int(idx.counts[j]) == int((ids == start + j).sum())

    hm, masked_m = permute.to_masked(x, idx, max_m=t)
    assert hm.shape == (e_local, t, 16)
    for j in range(e_local):
        assert (hm[j, int(masked_m[j]) :] == 0).all()
        toks = torch.nonzero((ids == start + j).any(1)).flatten()
        assert torch.equal(hm[j, : len(toks)], x[toks])  # stable: token order kept
    assert torch.allclose(permute.from_masked(hm, idx, w), expected, atol=1e-6)

    hc, row_expert, seg_start, slot_row = permute.to_contiguous(x, idx, alignment)
    assert hc.shape[0] == permute.contiguous_rows(t * k, e_local, alignment)
    assert (seg_start % alignment == 0).all()
    live = torch.zeros(hc.shape[0], dtype=torch.bool)
    for j in range(e_local):
        s, n = int(seg_start[j]), int(idx.counts[j])
        assert (row_expert[s : s + n] == j).all()
        live[s : s + n] = True
    assert (row_expert[~live] == -1).all()  # padding rows and the tail: -1
    inp = ContiguousInput(hc, None, row_expert, idx.counts, seg_start)
    assert torch.equal(inp.live_rows(), live)
    used = slot_row[idx.valid]
    assert used.unique().numel() == used.numel()  # no two slots share a row
    assert torch.allclose(permute.from_contiguous(hc, idx, slot_row, w), expected, atol=1e-6)


@given(routing())
@settings(max_examples=40, deadline=None)
def test_local_ids_mark_remote_experts(r):
    ids, e, ep_size, rank, _ = r
    e_local, start = e // ep_size, rank * (e // ep_size)
    local = permute.local_topk_ids(ids, start, e_local)
    inside = (ids >= start) & (ids < start + e_local)
    assert torch.equal(local[inside], (ids[inside] - start).to(torch.int32))
    assert (local[~inside] == -1).all()


def test_dispatchers_honour_the_masked_row_alignment():
    """Experts may need max_m to be a multiple of their tile (DeepGEMM: 64); the format says so
    and the dispatcher sizes the masked layout for it."""
    import moehal
    from moehal.formats import ActivationFormat, Layout
    from moehal.interfaces import BuildRequest
    from moehal.reference.dispatcher import ReferenceDispatcher

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)
    fmt = ActivationFormat(Layout.MASKED, torch.bfloat16, row_alignment=64)
    runner = ReferenceDispatcher().build(BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), moehal.detect("cpu")), fmt)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 1], [0, 3]], dtype=torch.int32)
    out, handle = runner.dispatch(torch.randn(5, 16).bfloat16(), moehal.TopK(ids, torch.rand(5, 2)))
    assert out.hidden.shape == (4, 64, 16)
    assert out.masked_m.tolist() == [3, 3, 2, 2]


def test_masked_counts_never_exceed_the_rows_given():
    """Unchecked ids (validate=False) may repeat an expert within a token, so an expert can get
    more slots than max_m = T rows. The experts' GEMMs take masked_m as their row bound: the
    counts are clamped to max_m and the extra slots dropped, as `cuda.permute` does. Before,
    masked_m said 8 rows of a 4-row buffer (DeepGEMM and the Triton masked GEMM then read and
    wrote past it), and the extra slots overwrote the last row."""
    ids = torch.tensor([[1, 1]] * 4, dtype=torch.int32)  # 8 slots for expert 1, max_m = 4
    x = torch.arange(4.0)[:, None].expand(4, 3).contiguous() + 1
    idx = permute.index_slots(ids, 0, 2)
    hm, masked_m = permute.to_masked(x, idx, max_m=4)
    assert masked_m.tolist() == [0, 4]
    assert torch.equal(hm[1], x[[0, 0, 1, 1]])  # the first 4 slots, in slot order; none overwritten
    w = torch.ones(4, 2)
    want = torch.cat([2 * x[:2], torch.zeros(2, 3)])  # tokens 2 and 3 lost both slots: they add nothing
    assert torch.equal(permute.from_masked(hm, idx, w), want)
