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


def test_the_row_counts_are_one_triton_free_definition():
    """The author guide sent vendors to `moehal.kernels.triton_permute.contiguous_rows(0, ...)`
    (0 rows for no slots), which needs Triton, and the Triton-free `moehal.permute` had a
    looser twin that gave 1024 rows for the same call: the reference dispatcher handed experts
    1024 rows for a 0-token batch. One definition now, importable without Triton."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # as on a machine without it (the npu extra brings none)
        from moehal import permute
        import moehal_npu.plugin
        print(permute.contiguous_rows(0, 8, 128), permute.contiguous_rows(3, 8, 128), permute.masked_rows(0))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # no slots: no rows; 3 slots reach at most 3 experts, so at most 3 segments of 128 rows
    assert done.stdout.split() == ["0", "384", "64"]
    try:
        from moehal.kernels import triton_permute
    except ImportError:
        return
    assert triton_permute.contiguous_rows is permute.contiguous_rows
    assert triton_permute.masked_rows is permute.masked_rows


def test_the_reference_dispatcher_hands_no_rows_for_no_tokens():
    """A contiguous-layout kernel behind the reference dispatcher got 1024 rows of padding for a
    0-token batch (the guide promises none) and 1024 for one token where 256 bound it."""
    import types

    import moehal
    from moehal.formats import ContiguousOutput
    from moehal.interfaces import ExpertsRunner

    seen = []

    class Runner(ExpertsRunner):
        def __init__(self, fmt):
            self.fmt = fmt

        def load(self, weights):
            pass

        def apply(self, inp):
            seen.append(tuple(inp.hidden.shape))
            return ContiguousOutput(torch.zeros_like(inp.hidden))

    class Rows(moehal.Experts):
        name, priority, devices = "rows", 50, frozenset({"cpu"})
        quant_schemes = frozenset({moehal.QuantScheme.parse("bf16")})

        def input_formats(self, req):
            return [moehal.ActivationFormat(moehal.Layout.CONTIGUOUS, req.config.dtype, row_alignment=128)]

        def build(self, req, fmt):
            return Runner(fmt)

    plugin = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: moehal.BackendInfo("rows", "0", "rows seen")),
        moehal_experts=moehal.hookimpl(lambda: [Rows()]),
    )
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    reg.register(plugin, "rows")
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128)
    layer = moehal.MoELayer(cfg, backend="rows", device="cpu", registry=reg)
    assert layer.plan.pipeline.dispatcher.qualname == "reference.local"
    bf16 = torch.bfloat16
    layer.load_weights(w13=torch.randn(8, 256, 256, dtype=bf16), w2=torch.randn(8, 256, 128, dtype=bf16))
    with torch.no_grad():
        layer(torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2))
        layer(torch.zeros(1, 256, dtype=torch.bfloat16), torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2))
    assert seen == [(0, 256), (256, 256)]
