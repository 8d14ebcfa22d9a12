"""The Triton permute/combine kernels against moehal.permute (the sync-free torch semantics)."""

from __future__ import annotations

import pytest
import torch
from moehal import permute as P
from moehal.kernels import triton_permute as TP
from moehal.quant import fp8

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H = 256


def _routing(t: int, e_global: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e_global, generator=g)[:k] for _ in range(t)]).int()
    return ids.to(DEV), (torch.rand(t, k, generator=g) + 0.1).to(DEV)


def _assert_fp8_matches(got_q, got_s, ref_q, ref_s):
    """Bitwise, interpreted and on the GPU: the scatter divides by IEEE division (`div_rn`), as
    the reference does on every device (session 48; before, a multiply by the reciprocal put
    values on the other side of the e4m3 grid's ties, docs/device-runs/2026-11-28-session48)."""
    assert torch.equal(got_s.cpu(), ref_s.cpu())
    assert torch.equal(got_q.cpu().view(torch.uint8), ref_q.cpu().view(torch.uint8))


def _x(t: int, seed: int) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEV)


def _bf16_buffer(masked: bool, t: int, k: int, e: int) -> TP.PaddedBuffer:
    """A bf16 destination for t tokens' top-k slots over e local experts: masked (rows in
    multiples of 8) or contiguous (segments aligned to 4 rows)."""
    if masked:
        return TP.alloc_padded((e, TP.masked_rows(t, 8)), H, torch.bfloat16, DEV, False)
    return TP.alloc_padded((TP.contiguous_rows(t * k, e, 4),), H, torch.bfloat16, DEV, False)


@pytest.fixture(
    params=[(1, False), (2, False), (1, True), (2, True)],
    ids=["one_block_per_load", "two_blocks_per_load", "token_rows", "token_rows_two_blocks"],
)
def scatter_variant(request, monkeypatch) -> tuple[int, bool]:
    """The scatter's tile: one column block (one 1x128 group when quantizing) per load, or two
    (`ScatterTile.blocks_per_load`: both groups quantized from one load, scales stored together);
    slots loading their own token's row, or each token's row loaded once for its top-k slots
    (`ScatterTile.token_rows`: where top-k is a power of two dividing the 8 slots a program
    takes here; other top-k fall back to slot rows)."""
    k, token_rows = request.param
    if k > 1 or token_rows:
        rule = TP.scatter_tile

        def variant(slots: int, h: int, block_h: int, **kw) -> TP.ScatterTile:
            t = rule(slots, h, block_h)
            return TP.ScatterTile(
                8 if token_rows else t.block_s, max(t.h_span, k * block_h), t.num_warps, k, token_rows
            )

        monkeypatch.setattr(TP, "scatter_tile", variant)
    return request.param


@pytest.mark.parametrize("quant,ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("ep", [(0, 5, 5), (3, 4, 10)])  # (expert_start, E_local, E_global)
@pytest.mark.parametrize("k", [3, 4])  # top-k: 4 lets token_rows variants load token rows
def test_masked_matches_torch_permute_across_calls(quant, ue8m0, ep, k, scatter_variant):
    start, e, e_glob = ep
    max_t = 9
    max_m = TP.masked_rows(max_t, 8)
    buf = TP.alloc_padded((e, max_m), H, torch.float8_e4m3fn if quant else torch.bfloat16, DEV, quant)
    for step, t in enumerate((9, 2, 7)):  # shrinking then growing: stale rows must be zeroed
        x = _x(t, step)
        ids, w = _routing(t, e_glob, k, step)
        r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=True, ue8m0=ue8m0)
        idx = P.index_slots(ids.cpu(), start, e)
        ref, counts = P.to_masked(x.cpu(), idx, max_m)
        assert torch.equal(r.counts.cpu(), counts)
        assert r.counts is buf.counts  # persistent: the GEMMs see one masked_m tensor call after call
        live = torch.arange(max_m)[None, :] < counts[:, None]
        got = r.hidden.cpu()
        assert (got.float()[~live] == 0).all(), "padding rows must be zero"
        if quant:
            q, s = fp8.quantize_group(ref.float(), ue8m0=ue8m0)
            _assert_fp8_matches(got[live], r.scales.cpu()[live], q[live], s[live])
        else:
            assert torch.equal(got, ref)
        # slot_row points at each local slot's row
        rows = r.slot_row.cpu().long()
        v = idx.valid
        assert torch.equal(rows[v], idx.slot_expert[v] * max_m + idx.slot_pos[v])
        assert (rows[~v] == -1).all()


@pytest.mark.parametrize("quant", [False, True])
def test_contiguous_matches_torch_permute_across_calls(quant, scatter_variant):
    _check_contiguous(quant, (8, 3, 6), align=8)


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("align", [8, 128])
def test_contiguous_batches_of_several_position_chunks(quant, align):
    """More than `POSITION_CHUNK` slots: the positions pass writes the segment starts, which the
    scatter reads (`SEG_GIVEN`); with an alignment that 64-row blocks divide, each bookkeeping
    program finds its block's one segment (`ROW_BLOCKS_IN_SEGMENT`). A one-chunk call between
    them takes the scatter's own sums, on the same buffer."""
    assert 550 * 4 > TP.POSITION_CHUNK >= 100 * 4
    _check_contiguous(quant, (600, 100, 550), align)


def _check_contiguous(quant: bool, steps: tuple[int, ...], align: int) -> None:
    start, e, e_glob, k = 2, 6, 12, 4
    m_pad = TP.contiguous_rows(max(steps) * k, e, align)
    buf = TP.alloc_padded((m_pad,), H, torch.float8_e4m3fn if quant else torch.bfloat16, DEV, quant)
    for step, t in enumerate(steps):
        x = _x(t, 10 + step)
        ids, w = _routing(t, e_glob, k, 10 + step)
        r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=False, alignment=align)
        idx = P.index_slots(ids.cpu(), start, e)
        ref, row_expert, seg_start, slot_row = P.to_contiguous(x.cpu(), idx, align)
        n = min(ref.shape[0], m_pad)
        assert torch.equal(r.segment_start.cpu(), seg_start)
        assert torch.equal(r.row_expert.cpu()[:n], row_expert[:n])
        assert (r.row_expert.cpu()[n:] == -1).all() and (row_expert[n:] == -1).all()
        v = idx.valid
        assert torch.equal(r.slot_row.cpu().long()[v], slot_row[v]) and (r.slot_row.cpu()[~v] == -1).all()
        got = r.hidden.cpu()
        assert (got[n:].float() == 0).all()
        if quant:
            q, s = fp8.quantize_group(ref[:n].float())
            used = ref[:n].abs().amax(1) > 0
            _assert_fp8_matches(got[:n][used], r.scales.cpu()[:n][used], q[used], s[used])
            assert (got[:n][~used].float() == 0).all()
        else:
            assert torch.equal(got[:n], ref[:n])


@pytest.mark.parametrize("masked", [True, False])
def test_static_scale_quantizes_as_the_reference_does(masked, scatter_variant):
    """fp8_tensor dispatch (`ScaleKind.STATIC_TENSOR`): rows quantized with the one static scale
    (x / scale saturated to +-448, `div_rn`: bitwise the reference's, on the GPU too), and that
    scale written to every 1x128 group's slot. The scale here saturates the largest values."""
    from moehal.formats import ScaleKind
    from moehal.quant.activation import quantize_activation

    start, e, e_glob, k, align = 0, 4, 4, 2, 8
    scale = torch.tensor([2.5 / 448], device=DEV)  # |x| > 2.5 saturates
    if masked:
        buf = TP.alloc_padded((e, TP.masked_rows(9, 8)), H, torch.float8_e4m3fn, DEV, True)
    else:
        buf = TP.alloc_padded((TP.contiguous_rows(9 * k, e, align),), H, torch.float8_e4m3fn, DEV, True)
    for step, t in enumerate((9, 4)):
        x = _x(t, 20 + step)
        ids, w = _routing(t, e_glob, k, 20 + step)
        r = TP.permute(
            x, ids, w, buf, expert_start=start, num_local_experts=e, masked=masked, alignment=align, static_scale=scale
        )
        rows = r.slot_row.cpu().long()
        flat_q = r.hidden.reshape(-1, H).cpu()[rows]
        flat_s = r.scales.reshape(-1, H // 128).cpu()[rows]
        slot_x = x.cpu().repeat_interleave(k, dim=0)
        q, s = quantize_activation(slot_x, ScaleKind.STATIC_TENSOR, scale.cpu())
        assert (slot_x.float().abs() > 2.5).any() and (q.float().abs() == 448).any()
        assert torch.equal(flat_q.float(), q.float()) and torch.equal(flat_s, s)
    with pytest.raises(ValueError, match="one scale value"):
        TP.permute(x, ids, w, buf, expert_start=0, num_local_experts=e, masked=masked, static_scale=scale.repeat(2))


def test_the_tile_rule_loads_token_rows_only_for_quantizing_prefill_with_a_power_of_two_top_k():
    """`scatter_tile`: what the H200 sweep measured (quantizing, 4096+ slots, top-8) gets token
    rows and four groups per load; everything else keeps the slot tile it had."""
    prefill = TP.scatter_tile(4096 * 8, 2048, 128, quant=True, top_k=8)
    assert prefill == TP.ScatterTile(16, 1024, 4, 4, token_rows=True)
    assert TP.scatter_tile(8192, 2048, 128, quant=True, top_k=2).token_rows  # Mixtral's top-2
    assert TP.scatter_tile(8192, 384, 128, quant=True, top_k=8).blocks_per_load == 1  # 3 groups
    assert TP.scatter_tile(8192, 768, 128, quant=True, top_k=8).blocks_per_load == 2  # 6 groups
    assert not TP.scatter_tile(8192, 2048, 128, quant=True, top_k=6).token_rows
    assert not TP.scatter_tile(8192, 2048, 256, quant=False, top_k=8).token_rows  # bf16
    assert not TP.scatter_tile(2048, 2048, 128, quant=True, top_k=8).token_rows  # 256 tokens


@pytest.mark.parametrize("masked", [True, False])
def test_a_prefill_sized_quantizing_scatter_with_the_shipped_tile_matches_the_reference(masked):
    """515 tokens of top-8 (4120 slots): the shipped rule's token-row tile, a half-filled last block included."""
    start, e, e_glob, k, t, align = 2, 12, 16, 8, 515, 8
    tile = TP.scatter_tile(t * k, H, 128, quant=True, top_k=k)
    x = _x(t, 40)
    ids, w = _routing(t, e_glob, k, 40)
    idx = P.index_slots(ids.cpu(), start, e)
    if masked:
        buf = TP.alloc_padded((e, TP.masked_rows(t, 64)), H, torch.float8_e4m3fn, DEV, True)
        r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=True)
        ref, counts = P.to_masked(x.cpu(), idx, buf.hidden.shape[1])
        live = torch.arange(ref.shape[1])[None, :] < counts[:, None]
    else:
        buf = TP.alloc_padded((TP.contiguous_rows(t * k, e, align),), H, torch.float8_e4m3fn, DEV, True)
        r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=False, alignment=align)
        ref = P.to_contiguous(x.cpu(), idx, align)[0]
        live = ref.abs().amax(1) > 0
        ref = ref[: buf.hidden.shape[0]]
        live = live[: buf.hidden.shape[0]]
    assert tile.token_rows
    q, sc = fp8.quantize_group(ref.float())
    _assert_fp8_matches(r.hidden.cpu()[live], r.scales.cpu()[live], q[live], sc[live])


def _check_no_scale_past_the_row(h: int, e: int, k: int, t: int, spare: int, seed: int) -> None:
    """A masked quantizing scatter of `t` tokens of width `h` under the current tile rule,
    against the reference, with `spare` group rows of NaNs past the scale tensor (the scales
    sit MN-major in a raw buffer) that a stray scale store would overwrite."""
    max_m = TP.masked_rows(t, 64)
    buf = TP.alloc_padded((e, max_m), h, torch.float8_e4m3fn, DEV, True)
    raw = torch.full((e, h // 128 + spare, max_m), float("nan"), device=DEV)
    buf.scales = raw.transpose(-1, -2)[..., : h // 128]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEV)
    ids, w = _routing(t, e, k, seed)
    r = TP.permute(x, ids, w, buf, expert_start=0, num_local_experts=e, masked=True)
    ref, counts = P.to_masked(x.cpu(), P.index_slots(ids.cpu(), 0, e), max_m)
    live = torch.arange(max_m)[None, :] < counts[:, None]
    q, sc = fp8.quantize_group(ref.float())
    _assert_fp8_matches(r.hidden.cpu()[live], r.scales.cpu()[live], q[live], sc[live])
    assert raw[:, h // 128 :].isnan().all(), "a scale was stored past the last group"


def test_a_load_past_the_last_group_writes_no_scale(monkeypatch):
    """Three 1x128 groups scattered two groups per load: the second load's upper half lies past
    the row, and its scale slot past the scale tensor must stay untouched."""
    monkeypatch.setattr(TP, "scatter_tile", lambda slots, hh, bh, **kw: TP.ScatterTile(4, 2 * bh, 4, 2))
    _check_no_scale_past_the_row(h=384, e=4, k=2, t=6, spare=1, seed=5)


def test_the_shipped_tile_stores_no_scale_past_the_row_of_twelve_groups():
    """Hidden 1536 (12 groups) with the shipped rule: 256 slots take 8-group programs, so the
    second column chunk spans groups 8-15. Before session 24 its scale stores were masked by
    slot only, and groups 12-15 landed past the scale tensor."""
    tile = TP.scatter_tile(64 * 4, 1536, 128, quant=True, top_k=4)
    assert tile.h_span == 1024 and 1536 % tile.h_span  # the second chunk runs past the row
    _check_no_scale_past_the_row(h=1536, e=4, k=4, t=64, spare=4, seed=6)


@pytest.mark.parametrize("masked", [True, False])
def test_combine_matches_reference_weighted_sum(masked):
    start, e, e_glob, k, t = 1, 5, 8, 3, 7
    ids, w = _routing(t, e_glob, k, 3)
    x = _x(t, 3)
    buf = _bf16_buffer(masked, t, k, e)
    r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=masked, alignment=4)
    y = torch.randn(buf.hidden.shape, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    out = TP.combine(y, r.slot_row, w, t, k, masked=masked, scaling=2.5, out_dtype=torch.float32)
    # independent float64 oracle
    ref = torch.zeros(t, H, dtype=torch.float64)
    yc = y.cpu().double().reshape(-1, H)
    for tt in range(t):
        for kk in range(k):
            row = int(r.slot_row[tt * k + kk])
            if row >= 0:
                ref[tt] += float(w[tt, kk]) * yc[row]
    torch.testing.assert_close(out.cpu().double(), ref * 2.5, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("ep", [(0, 5, 5), (3, 4, 10)])  # (expert_start, E_local, E_global)
def test_padding_ids_reach_no_row(masked, ep):
    """-1 ids (`MoEConfig.topk_padding`): no expert counts them, their slots point at no row,
    and the combine adds nothing for them: padded tokens' rows come out zero."""
    start, e, e_glob = ep
    t, k = 7, 3
    ids, w = _routing(t, e_glob, k, 11)
    ids[::3] = -1
    ids[1::4, 0] = -1
    x = _x(t, 11)
    buf = _bf16_buffer(masked, t, k, e)
    r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=masked, alignment=4)
    idx = P.index_slots(ids.cpu(), start, e)
    assert torch.equal(r.counts.cpu().int(), idx.counts)
    rows = r.slot_row.cpu().long()
    assert (rows[(ids.cpu() < 0).reshape(-1)] == -1).all()
    y = torch.randn(buf.hidden.shape, generator=torch.Generator().manual_seed(12)).bfloat16().to(DEV)
    out = TP.combine(y, r.slot_row, w, t, k, masked=masked, scaling=1.0, out_dtype=torch.float32).cpu()
    assert torch.equal(out[::3], torch.zeros_like(out[::3]))
    assert out[1::3].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_on_input_scales_rows(dtype):
    """Rows times the router weight, rounded once to the layer dtype (the interpreted kernel
    once rounded them to bf16 whatever the dtype: fp16 and fp32 layers lost precision)."""
    e, t = 4, 5
    ids, w = _routing(t, e, 1, 7)
    x = _x(t, 7).to(dtype)
    buf = TP.alloc_padded((e, TP.masked_rows(t, 8)), H, dtype, DEV, False)
    r = TP.permute(x, ids, w, buf, expert_start=0, num_local_experts=e, masked=True, weight_on_input=True)
    idx = P.index_slots(ids.cpu(), 0, e)
    scaled = (x.cpu().float() * w.cpu()).to(dtype)
    ref, _ = P.to_masked(scaled, idx, buf.hidden.shape[1])
    assert torch.equal(r.hidden.cpu(), ref)


def test_masked_shrink_spread_over_programs_zeroes_every_stale_row():
    """A prefill-sized call, then a decode-sized one: each expert's stale rows are zeroed by
    several programs (stale_splits > 1), and the last of them records the new counts."""
    e, k, max_t = 3, 2, 1500
    max_m = TP.masked_rows(max_t, 64)
    assert TP.stale_splits(max_m, 64, e) > 1
    buf = TP.alloc_padded((e, max_m), 128, torch.bfloat16, DEV, False)
    g = torch.Generator().manual_seed(11)
    for t in (max_t, 2, 700, 0, 5):
        x = torch.randn(t, 128, generator=g).bfloat16().to(DEV)
        ids = torch.argsort(torch.rand(t, e, generator=g), dim=1)[:, :k].int().to(DEV)
        w = torch.ones(t, k, device=DEV)
        r = TP.permute(x, ids, w, buf, expert_start=0, num_local_experts=e, masked=True)
        counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=e)
        assert torch.equal(r.counts.cpu().long(), counts)
        live = torch.arange(max_m)[None, :] < counts[:, None]
        assert (buf.hidden.cpu()[~live] == 0).all(), f"stale rows survived after {t} tokens"
        assert torch.equal(buf.expert_rows[0].cpu().long(), counts), "counts recorded for the next call"
        assert (buf.expert_rows[1] == 0).all(), "arrival counters reset"


@pytest.mark.parametrize("masked", [True, False])
def test_positions_over_several_chunks(monkeypatch, masked):
    """Batches larger than one positions chunk: positions count the expert's slots in earlier
    chunks (a counts pass first), and match moehal.permute exactly."""
    monkeypatch.setattr(TP, "POSITION_CHUNK", 256)
    monkeypatch.setattr(TP, "FUSED_POSITIONS_MAX_SLOTS", 0)
    start, e, e_glob, k, t = 2, 5, 9, 3, 300  # 900 slots: 4 chunks of 256
    ids, w = _routing(t, e_glob, k, 21)
    x = _x(t, 21)
    buf = _bf16_buffer(masked, t, k, e)
    r = TP.permute(x, ids, w, buf, expert_start=start, num_local_experts=e, masked=masked, alignment=4)
    idx = P.index_slots(ids.cpu(), start, e)
    v = idx.valid
    assert torch.equal(r.counts.cpu().long(), torch.bincount(idx.slot_expert[v], minlength=e))
    assert (r.counts is buf.counts) == masked  # the positions pass writes the masked buffer's counts
    if masked:
        want = idx.slot_expert[v] * buf.hidden.shape[1] + idx.slot_pos[v]
    else:
        want = P.to_contiguous(x.cpu(), idx, 4)[3][v]
    assert torch.equal(r.slot_row.cpu().long()[v], want) and (r.slot_row.cpu()[~v] == -1).all()
    if masked:
        ref, _ = P.to_masked(x.cpu(), idx, buf.hidden.shape[1])
        assert torch.equal(r.hidden.cpu(), ref)


@pytest.mark.parametrize("alignment", [1, 8])
def test_an_undersized_contiguous_destination_is_refused_before_the_launch(alignment):
    """The scatter writes each slot at its segment start plus its position without a bound:
    64 tokens into a buffer sized for 2 corrupted the heap on the CPU (security review
    2026-11-29, finding 10). Binding compares the rows with the worst case (host integers, no
    sync) and refuses one row short; the worst case itself is taken."""
    t, k, e = 64, 2, 4
    ids, w = _routing(t, e, k, 3)
    need = TP.contiguous_rows(t * k, e, alignment)
    kw = dict(expert_start=0, num_local_experts=e, masked=False, alignment=alignment)
    for rows in (TP.contiguous_rows(2 * k, e, alignment), need - 1):
        small = TP.alloc_padded((rows,), H, torch.bfloat16, DEV, False)
        # the bind first: it launches nothing, so code without the check fails here, harmlessly
        with pytest.raises(ValueError, match=rf"has {rows} rows.*contiguous_rows\({t * k}, {e}, {alignment}\)"):
            TP.bind_permute(t, k, H, small, **kw)
        with pytest.raises(ValueError, match="allocate it with"):
            TP.permute(_x(t, 1), ids, w, small, **kw)
        assert not small.hidden.any() and not small.written.any()  # nothing was written
    exact = TP.alloc_padded((need,), H, torch.bfloat16, DEV, False)
    r = TP.permute(_x(t, 1), ids, w, exact, **kw)
    assert r.counts.sum().item() == t * k and (r.slot_row >= 0).all() and (r.slot_row < need).all()


def test_no_slots_count_zero_for_every_expert():
    """A grid of no programs would leave the counts as allocated: garbage, which a contiguous
    layout turned into segment ends past its rows (an illegal instruction in DeepGEMM on an
    H200, docs/device-runs/2026-11-25-session33). The positions pass runs one chunk at least."""
    poisoned = torch.full((6,), 7, dtype=torch.int32, device=DEV)
    _, counts = TP.expert_positions(torch.zeros(0, dtype=torch.int32, device=DEV), 6, counts=poisoned)
    assert counts is poisoned and counts.tolist() == [0] * 6
    for masked in (False, True):  # masked: the scatter's own count programs (fused positions)
        lead = (6, 64) if masked else (TP.contiguous_rows(0, 6, 8),)
        buf = TP.alloc_padded(lead, H, torch.bfloat16, DEV, False)
        r = TP.permute(
            _x(0, 1), torch.zeros(0, 2, dtype=torch.int32, device=DEV), None, buf,
            expert_start=0, num_local_experts=6, masked=masked, alignment=8,
        )  # fmt: skip
        assert r.counts.tolist() == [0] * 6 and r.slot_row.numel() == 0
        if not masked:
            assert r.hidden.shape[0] == 0 and r.row_expert.numel() == 0 and r.segment_start.tolist() == [0] * 6


def test_contiguous_buffers_are_sized_per_call_within_one_allocation():
    """A contiguous workspace hands each call its own rows of one persistent buffer: the
    GEMMs see this call's M (DeepGEMM computes every row it gets), the memory and the
    written-rows bitmap are shared, and FP8 scales stay MN-major with a stride aligned to M."""
    cap = TP.contiguous_rows(64 * 2, 8, 4)
    small = TP.contiguous_workspace(
        "test.prefix", TP.contiguous_rows(3 * 2, 8, 4), cap, 256, torch.float8_e4m3fn, DEV, True
    )
    full = TP.workspace("test.prefix", (cap,), 256, torch.float8_e4m3fn, DEV, True)
    m = small.hidden.shape[0]
    assert m < cap and small.hidden.data_ptr() == full.hidden.data_ptr()
    assert small.written.numel() == m and small.written.data_ptr() == full.written.data_ptr()
    assert small.scales.shape == (m, 2) and small.scales.stride() == (1, TP.round_up(m, 4))
    assert small.scales.untyped_storage().data_ptr() == full.scales.untyped_storage().data_ptr()
    assert TP.contiguous_workspace("test.prefix", m, cap, 256, torch.float8_e4m3fn, DEV, True) is small  # cached
    assert full.prefix(cap) is full
    with pytest.raises(ValueError, match="prefix"):
        full.prefix(cap + 1)


def test_buffers_fetched_inside_a_capture_are_recorded_for_its_graph(monkeypatch):
    """`fetched_buffers`: every workspace and scratch tensor fetched inside the block (fresh or
    already there) is recorded for the graph being captured, which keeps them past
    `release_workspaces`; nothing is recorded outside a block, and nested blocks record their own."""
    from moehal.kernels.host import fetched_buffers

    monkeypatch.setattr(TP, "_WORKSPACE", {})
    monkeypatch.setattr(TP, "_SCRATCH", {})
    before = TP.workspace("test.fetch", (2, 64), 128, torch.bfloat16, DEV, False)
    with fetched_buffers() as outer:
        again = TP.workspace("test.fetch", (2, 64), 128, torch.bfloat16, DEV, False)
        rows = TP.scratch("test.fetch", (8,), torch.int32, DEV)
        with fetched_buffers() as inner:
            fresh = TP.workspace("test.fetch", (2, 128), 128, torch.bfloat16, DEV, False)
        TP.scratch("test.fetch", (8,), torch.int32, DEV)
    assert again is before and outer == [before, rows, rows] and inner == [fresh]
    TP.workspace("test.fetch", (2, 64), 128, torch.bfloat16, DEV, False)
    assert outer == [before, rows, rows], "nothing is recorded after the block"
    TP.release_workspaces(DEV)
    assert outer[0].hidden.shape == (2, 64, 128), "what a graph recorded stays allocated"


def test_released_workspaces_are_forgotten_and_counted(monkeypatch):
    """`release_workspaces`: later calls allocate afresh; buffers already handed out stay valid
    (their layers keep them); only the named device's are dropped."""
    monkeypatch.setattr(TP, "_WORKSPACE", {})
    monkeypatch.setattr(TP, "_SCRATCH", {})
    a = TP.workspace("test.release", (4, 64), 256, torch.float8_e4m3fn, DEV, True)
    other = torch.device("meta")
    b = TP.workspace("test.release", (4, 64), 256, torch.bfloat16, other, False)
    held = 4 * 64 * 256 + 4 * 2 * 64 * 4 + 2 * 4 * 4 + 4 * 4  # fp8 rows, fp32 scales, row state, counts
    assert TP.release_workspaces(DEV) == held
    assert TP.workspace("test.release", (4, 64), 256, torch.float8_e4m3fn, DEV, True) is not a
    assert a.hidden.shape == (4, 64, 256), "a buffer handed out before stays as it was"
    assert TP.workspace("test.release", (4, 64), 256, torch.bfloat16, other, False) is b, "another device's stays"
    assert TP.release_workspaces() > 0 and not TP._WORKSPACE
    # scratch (a kept bind's slot rows, the token-major kernels' activation rows) goes the same way
    rows = TP.scratch("test.release", (16,), torch.int32, DEV)
    assert TP.scratch("test.release", (16,), torch.int32, DEV) is rows
    assert TP.scratch("test.release", (16,), torch.int32, other) is not rows
    assert TP.release_workspaces(DEV) == 16 * 4 and len(TP._SCRATCH) == 1
    assert TP.scratch("test.release", (16,), torch.int32, DEV) is not rows
    if DEV.type == "cuda":  # "cuda" and the current device's index name the same buffers
        indexed = torch.device("cuda", torch.cuda.current_device())
        kept = TP.scratch("test.release", (16,), torch.int32, indexed)
        assert TP.scratch("test.release", (16,), torch.int32, torch.device("cuda")) is kept
        assert TP.release_workspaces("cuda") > 0
        assert TP.scratch("test.release", (16,), torch.int32, indexed) is not kept


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_the_dispatcher_binds_each_decode_token_count_once(layout, monkeypatch):
    """`cuda.permute` keeps its permute launches per token count (`tp.bind_permute`) up to
    `KEEP_BOUND_TOKENS`; token counts taking turns reuse them with new inputs, and the round
    trip (identity experts) matches the reference dispatcher's at every call."""
    from moehal.config import MoEConfig
    from moehal.formats import ActivationFormat, ContiguousOutput, Layout, MaskedOutput
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.quant import QuantScheme
    from moehal.reference.dispatcher import ReferenceDispatcher
    from moehal.routing import TopK
    from moehal_cuda import dispatch

    monkeypatch.setattr(dispatch, "KEEP_BOUND_TOKENS", 8)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=H, intermediate_size=128, max_tokens=16)
    req = BuildRequest(cfg, QuantScheme.parse("bf16"), detect(DEV))
    lay = Layout(layout)
    fmt = ActivationFormat(lay, torch.bfloat16, row_alignment=4 if layout == "contiguous" else 1)
    out_type = MaskedOutput if lay is Layout.MASKED else ContiguousOutput
    runner = dispatch.CudaPermuteDispatcher().build(req, fmt)
    ref = ReferenceDispatcher().build(req, fmt)
    for i, t in enumerate((3, 5, 3, 12, 3, 12)):
        x = _x(t, i)
        topk = TopK(*_routing(t, 8, 2, i))
        inp, handle = runner.dispatch(x, topk)
        y = runner.combine(out_type(inp.hidden), handle)
        rinp, rhandle = ref.dispatch(x.cpu(), TopK(topk.ids.cpu(), topk.weights.cpu()))
        want = ref.combine(out_type(rinp.hidden), rhandle)
        torch.testing.assert_close(y.cpu().float(), want.float(), rtol=1e-2, atol=1e-2)
    assert sorted(runner._bound) == [3, 5], "decode counts kept, 12 tokens (> KEEP_BOUND_TOKENS) bound per call"
    assert all(combine.num_tokens == t for t, (_, combine) in runner._bound.items()), "each count's own combine"
    # a kept count's slot rows are process-wide scratch, written by every call: no allocation
    rows = runner._bound[3][0].slot_rows
    assert rows is not None and rows.shape == (6,)
    assert runner.dispatch(_x(3, 9), TopK(*_routing(3, 8, 2, 9)))[1].slot_row is rows


@pytest.mark.parametrize("masked", [True, False])
def test_a_bound_combine_matches_combine_at_every_call_and_refuses_what_it_was_not_bound_for(masked):
    """`bind_combine` once, then calls on new expert rows, routings and `out` buffers: the same
    bits as `combine` binding at each call. A call it was not bound for (weights present or
    not, width, out dtype) raises instead of launching with the wrong constexprs."""
    e, k, t = 5, 3, 6
    launch = TP.bind_combine(t, k, H, masked=masked, weighted=True, scaling=1.5, out_dtype=torch.bfloat16)
    for i in range(3):
        ids, w = _routing(t, e, k, 10 + i)
        if masked:
            buf = TP.alloc_padded((e, TP.masked_rows(t, 8)), H, torch.bfloat16, DEV, False)
        else:
            buf = TP.alloc_padded((TP.contiguous_rows(t * k, e, 4),), H, torch.bfloat16, DEV, False)
        r = TP.permute(_x(t, i), ids, w, buf, expert_start=0, num_local_experts=e, masked=masked, alignment=4)
        y = torch.randn(buf.hidden.shape, generator=torch.Generator().manual_seed(i)).bfloat16().to(DEV)
        want = TP.combine(y, r.slot_row, w, t, k, masked=masked, scaling=1.5)
        out = torch.full((t, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        assert launch(y, r.slot_row, w, out) is out and torch.equal(out, want), f"call {i}"
        assert torch.equal(launch(y, r.slot_row, w, None), want)
    with pytest.raises(ValueError, match="bound for weighted"):
        launch(y, r.slot_row, None, None)
    with pytest.raises(ValueError, match="into torch.bfloat16"):
        launch(y, r.slot_row, w, torch.empty(t, H, dtype=torch.float32, device=DEV))
    # the kernel steps out's rows by stride(0) and its columns by 1: a column-major out raises
    with pytest.raises(ValueError, match="column stride 6"):
        launch(y, r.slot_row, w, torch.empty(H, t, dtype=torch.bfloat16, device=DEV).t())


@pytest.mark.parametrize("fused", [True, False], ids=["fused-positions", "positions-pass"])
def test_masked_rows_past_max_m_are_dropped_not_written_into_the_next_expert(fused, monkeypatch):
    """Ids that break the contract (a token naming one expert twice; only `validate_values`
    checks) can send an expert more slots than its max_m rows. Those slots are dropped (row
    -1) and the count stops at max_m: the next expert's rows, and memory past the buffer for
    the last expert, are never written, and the next call's stale-row zeroing stays inside."""
    if not fused:
        monkeypatch.setattr(TP, "FUSED_POSITIONS_MAX_SLOTS", 0)
    t, k, e, h = 8, 2, 3, 64
    max_m = TP.masked_rows(t, 8)
    buf = TP.alloc_padded((e, max_m), h, torch.bfloat16, DEV, False)
    x = torch.arange(1, t + 1).float()[:, None].repeat(1, h).bfloat16().to(DEV)
    for expert in (0, e - 1):  # the last expert's overflow would land past the buffer
        ids = torch.full((t, k), expert, dtype=torch.int32, device=DEV)  # 16 slots, 8 rows
        r = TP.permute(x, ids, torch.ones(t, k, device=DEV), buf, expert_start=0, num_local_experts=e, masked=True)
        counts = r.counts.cpu().tolist()
        assert counts[expert] == max_m and sum(counts) == max_m, counts
        rows = r.slot_row.cpu()
        assert (rows >= 0).sum() == max_m and (rows[rows >= 0] // max_m == expert).all()
        others = [i for i in range(e) if i != expert]
        assert buf.hidden[others].abs().sum() == 0  # nothing spilled into another expert
    good = torch.tensor([[0, 1]] * t, dtype=torch.int32, device=DEV)  # back to valid ids
    r = TP.permute(x, good, torch.ones(t, k, device=DEV), buf, expert_start=0, num_local_experts=e, masked=True)
    assert r.counts.cpu().tolist() == [t, t, 0] and buf.hidden[2].abs().sum() == 0


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_layers_without_max_tokens_keep_a_few_buffers_for_a_stream_of_batch_sizes(layout, monkeypatch):
    """With no `max_tokens` the dispatcher's buffers are sized by each call; keyed by the exact
    size, every new batch size (prefill lengths, an expert-parallel rank's arrivals) kept a
    buffer of its own for the process's life. Rounded up to powers of two, 1..40 tokens keep
    at most 7 (1, 2, 4, ..., 64 slots' worth), and DeepGEMM's contiguous buffers follow the
    same rule (capacity 0)."""
    from moehal.config import MoEConfig
    from moehal.formats import ActivationFormat, Layout
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.quant import QuantScheme
    from moehal.routing import TopK
    from moehal_cuda import dispatch
    from moehal_cuda.deepgemm_experts import DeepGemmExpertsRunner, TorchGemmOps

    monkeypatch.setattr(TP, "_WORKSPACE", {})
    monkeypatch.setattr(dispatch, "KEEP_BOUND_TOKENS", 0)  # every size bound per call, as prefill is
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)  # max_tokens=None
    req = BuildRequest(cfg, QuantScheme.parse("bf16"), detect(DEV))
    fmt = ActivationFormat(Layout(layout), torch.bfloat16, row_alignment=4)
    run = dispatch.CudaPermuteDispatcher().build(req, fmt)
    g = torch.Generator().manual_seed(3)
    for t in range(1, 41):
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)]).int().to(DEV)
        x = torch.randn(t, 64, generator=g).bfloat16().to(DEV)
        inp, _ = run.dispatch(x, TopK(ids, torch.rand(t, 2, generator=g).to(DEV)))
        assert inp.hidden.shape[-1] == 64
    assert len(TP._WORKSPACE) <= 7, sorted(k[1] for k in TP._WORKSPACE)
    assert DeepGemmExpertsRunner(req, fmt, TorchGemmOps(False)).contiguous_capacity(123) == 0


def test_each_thread_records_the_buffers_its_own_capture_fetched(monkeypatch):
    """Captures in two threads (one per GPU) at once: each records what it fetched, not the
    other's (the record was one module-level stack, so one thread's fetch landed in the
    other's list, or its pop took the other's)."""
    import threading

    from moehal.kernels.host import fetched_buffers

    monkeypatch.setattr(TP, "_SCRATCH", {})
    inside, release = threading.Barrier(2), threading.Event()
    got: dict[str, list] = {}

    def capture(name: str) -> None:
        with fetched_buffers() as held:
            inside.wait()  # both blocks open at once
            TP.scratch(f"test.thread.{name}", (4,), torch.int32, DEV)
            if name == "a":
                release.set()
            else:
                release.wait()
        got[name] = held

    threads = [threading.Thread(target=capture, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a = TP._SCRATCH[("test.thread.a", (4,), torch.int32, TP._device_key(DEV))]
    b = TP._SCRATCH[("test.thread.b", (4,), torch.int32, TP._device_key(DEV))]
    assert got["a"] == [a] and got["b"] == [b]
