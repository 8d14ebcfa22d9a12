"""The Triton masked grouped GEMM (`moehal.kernels.triton_grouped_gemm`) against torch, the
tuned-table lookup of `moehal_cuda.gemm_choice`, and the tuner's host-side pieces. On CPU the
kernel runs under the Triton interpreter (tests/cuda/conftest.py sets it)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moehal.kernels.tiles import TileConfig
from moehal.kernels.triton_grouped_gemm import (
    contiguous_grouped_gemm,
    default_config,
    masked_grouped_gemm,
    num_m_tiles,
)
from moehal.quant import fp8
from moehal_cuda.gemm_choice import MIN_GAIN, TUNED_DIR, GemmChooser, entry_key, nearest, table_path
from moehal_cuda.tuning import candidate_configs, routing_counts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(e, max_m, n, k, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(e, max_m, k, generator=g)
    w = torch.randn(e, n, k, generator=g) / k**0.5
    return a, w, torch.tensor(counts, dtype=torch.int32)


@pytest.mark.parametrize(
    "counts,cfg",
    [
        ([3, 0, 64, 17, 1], TileConfig(16, 32, 64, 1, 4, 1)),
        ([0, 0, 0, 0, 0], TileConfig(16, 32, 64, 1, 4, 1)),
        ([64, 64, 64, 64, 64], TileConfig(32, 64, 64, 2, 4, 1)),  # grouped order over M tiles
        ([5, 40, 0, 2, 33], TileConfig(16, 64, 128, 4, 4, 1)),
    ],
)
def test_bf16_rows_match_torch_and_padding_is_untouched(counts, cfg):
    e, max_m, n, k = 5, 64, 96, 128
    a, w, mm = _problem(e, max_m, n, k, counts)
    a, w = a.bfloat16().to(DEV), w.bfloat16().to(DEV)
    out = torch.full((e, max_m, n), 7.0, dtype=torch.bfloat16, device=DEV)
    masked_grouped_gemm(a, None, w, None, out, mm.to(DEV), sum(counts), cfg)
    ref = torch.einsum("emk,enk->emn", a.float(), w.float()).bfloat16()
    for i, c in enumerate(counts):
        got, want = out[i, :c].float(), ref[i, :c].float()
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), f"expert {i}"
        assert (out[i, c:] == 7).all(), f"expert {i}: rows past masked_m were written"


def _exact_operands(shape, seed):
    """bf16 values with few significant bits (e2m1 codes times powers of two, as NVFP4's codes
    times e4m3 block scales are): products and fp32 sums over K = 128 are exact, so the kernels'
    output rounding is the only one and a test can ask for bits."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = codes[torch.randint(0, 8, shape, generator=g)] * 2.0 ** torch.randint(-3, 3, shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.5, -v, v).bfloat16()


def test_out_scale_is_applied_before_the_one_rounding():
    """Each expert's output times its fp32 factor, rounded once: round(acc * s), which a bf16
    GEMM rounded before scaling (round(round(acc) * s)) misses in about a quarter of values
    (NVFP4's global scales, moehal_cuda.nvfp4_dequant)."""
    e, max_m, n, k, counts = 4, 32, 64, 128, [5, 0, 32, 17]
    a, w = _exact_operands((e, max_m, k), 1).to(DEV), _exact_operands((e, n, k), 2).to(DEV)
    scale = (torch.rand(e, generator=torch.Generator().manual_seed(3)) * 1e-3 + 1e-4).to(DEV)
    out = torch.full((e, max_m, n), 7.0, dtype=torch.bfloat16, device=DEV)
    mm = torch.tensor(counts, dtype=torch.int32, device=DEV)
    masked_grouped_gemm(a, None, w, None, out, mm, sum(counts), TileConfig(16, 32, 64, 1, 4, 1), out_scale=scale)
    exact = torch.einsum("emk,enk->emn", a.double(), w.double()) * scale.double()[:, None, None]
    twice = torch.einsum("emk,enk->emn", a.double(), w.double()).bfloat16().double() * scale.double()[:, None, None]
    for i, c in enumerate(counts):
        assert torch.equal(out[i, :c], exact[i, :c].float().bfloat16()), f"expert {i}"
        assert (out[i, c:] == 7).all(), f"expert {i}: rows past masked_m were written"
    live = torch.cat([exact[i, :c].float().bfloat16().float().flatten() for i, c in enumerate(counts)])
    rounded_twice = torch.cat([twice[i, :c].float().bfloat16().float().flatten() for i, c in enumerate(counts)])
    assert (live != rounded_twice).any(), "the inputs should tell one rounding from two"
    with pytest.raises(ValueError, match="out_scale must be fp32"):
        masked_grouped_gemm(a, None, w, None, out, mm, 1, out_scale=scale.double())


@pytest.mark.parametrize("contiguous", [False, True])
def test_bias_is_added_after_the_scale_before_the_one_rounding(contiguous):
    """round(acc x s + b), as the reference computes h = x @ w^T + b in fp32 and rounds once.
    Powers-of-two factors and few-bit operands over K = 64 keep every fp32 step exact (with or
    without a fused multiply-add), so the test can ask for bits; adding the bias to a rounded
    output (the NVFP4 experts' add after GEMM1 until session 50) misses some of them."""
    e, n, k, counts = 4, 48, 64, [5, 0, 16, 9]
    w = _exact_operands((e, n, k), 8).to(DEV)
    scale = torch.tensor([0.5, 2.0, 0.25, 1.0], device=DEV)
    bias = (_exact_operands((e, n), 9).float() * 4).to(DEV)
    if contiguous:
        row_expert = sum(([i] * c + [-1] * (-(-c // 16) * 16 - c) for i, c in enumerate(counts)), [])
        a = _exact_operands((len(row_expert), k), 10).to(DEV)
        out = torch.full((len(row_expert), n), 7.0, dtype=torch.bfloat16, device=DEV)
        re = torch.tensor(row_expert, dtype=torch.int32, device=DEV)
        contiguous_grouped_gemm(a, w, out, re, 16, out_scale=scale, config=TileConfig(16, 32, 64, 1, 4, 1), bias=bias)
        rows = [(r, ex, a[r], out[r]) for r, ex in enumerate(row_expert)]
    else:
        a = _exact_operands((e, 16, k), 10).to(DEV)
        out = torch.full((e, 16, n), 7.0, dtype=torch.bfloat16, device=DEV)
        mm = torch.tensor(counts, dtype=torch.int32, device=DEV)
        masked_grouped_gemm(a, None, w, None, out, mm, sum(counts), TileConfig(16, 32, 64, 1, 4, 1), scale, bias)
        rows = [(i * 16 + m, i if m < c else -1, a[i, m], out[i, m]) for i, c in enumerate(counts) for m in range(16)]
    missed = 0
    for r, ex, x, got in rows:
        if ex < 0:
            assert (got == 7).all(), f"row {r}: a padding row was written"
            continue
        acc = (x.double() @ w[ex].double().t()) * scale[ex].double()
        assert torch.equal(got, (acc + bias[ex].double()).float().bfloat16()), f"row {r} (expert {ex})"
        missed += int((got != (acc.float().bfloat16().double() + bias[ex].double()).float().bfloat16()).sum())
    assert missed, "the inputs should tell one rounding from two"
    with pytest.raises(ValueError, match="bias must be fp32"):
        if contiguous:
            contiguous_grouped_gemm(a, w, out, re, 16, bias=bias.bfloat16())
        else:
            masked_grouped_gemm(a, None, w, None, out, mm, 1, bias=bias[:, :-1])


@pytest.mark.parametrize("tile", [TileConfig(16, 32, 64, 1, 4, 1), TileConfig(32, 64, 128, 2, 4, 1)])
def test_contiguous_rows_match_their_experts_and_padding_is_untouched(tile):
    """Segments aligned to 32 rows (a multiple of both tiles' rows), padding rows read -1; the
    tail past the last segment is padding too."""
    e, n, k, align = 4, 64, 128, 32
    counts = [5, 0, 40, 17]
    starts, row_expert = [], []
    for i, c in enumerate(counts):
        starts.append(len(row_expert))
        seg = -(-c // align) * align
        row_expert += [i] * c + [-1] * (seg - c)
    row_expert += [-1] * 24
    m = len(row_expert)
    a, w = _exact_operands((m, k), 4).to(DEV), _exact_operands((e, n, k), 5).to(DEV)
    re = torch.tensor(row_expert, dtype=torch.int32, device=DEV)
    scale = torch.tensor([0.5, 2.0, 1e-3, 3.0], device=DEV)
    out = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=DEV)
    contiguous_grouped_gemm(a, w, out, re, align, out_scale=scale, config=tile)
    for r, ex in enumerate(row_expert):
        if ex < 0:
            assert (out[r] == 7).all(), f"padding row {r} was written"
        else:
            want = ((a[r].double() @ w[ex].double().t()) * scale[ex].double()).float().bfloat16()
            assert torch.equal(out[r], want), f"row {r} (expert {ex})"
    with pytest.raises(ValueError, match="shapes do not match"):
        contiguous_grouped_gemm(a, w, out[:-1], re, align)
    with pytest.raises(ValueError, match="aligned to 8 rows"):  # tl.dot's 16 rows would span segments
        contiguous_grouped_gemm(a, w, out, re, 8)


def _rows_beyond_int32(m, k, dev, tmp_path):
    """A zero bf16 `[m, k]` matrix whose m x k elements pass 2^31 (4.3 GB): on the CPU a sparse
    file mapped into memory, so only the pages a test writes or a kernel reads take memory."""
    if dev != "cpu":
        return torch.zeros(m, k, dtype=torch.bfloat16, device=dev)
    import numpy as np

    mapped = np.memmap(tmp_path / "a.bin", dtype=np.int16, mode="w+", shape=(m, k))
    return torch.from_numpy(mapped).view(torch.bfloat16)


def test_contiguous_rows_past_int32_offsets_are_addressed_in_int64(tmp_path):
    """A contiguous buffer whose live rows lie past 2^31 elements (row x K), as an NVFP4 layer
    built without a token bound gets for Mixtral-8x7B's GEMM1 output from about 37k tokens: the
    tile's first row moves the pointers in int64. In int32 the offsets wrapped, and the kernel
    read outside the buffer (an illegal address on an H200, a crash under the interpreter)."""
    k, n, align = 8192, 32, 128
    m = (2**31 // k + 2 * align) // align * align  # the last segment starts past 2^31 elements
    assert (m - align) * k >= 2**31
    a = _rows_beyond_int32(m, k, DEV, tmp_path)
    a[m - align :, :256] = _exact_operands((align, 256), 6).to(DEV)  # the rest of K reads zeros
    w = _exact_operands((1, n, k), 7).to(DEV)
    re = torch.full((m,), -1, dtype=torch.int32, device=DEV)
    re[m - align :] = 0
    out = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=DEV)
    contiguous_grouped_gemm(a, w, out, re, align, config=TileConfig(128, 32, 256, 1, 4, 1))
    want = (a[m - align :, :256].double() @ w[0, :, :256].double().t()).float().bfloat16()
    assert torch.equal(out[m - align :], want)
    assert (out[: m - align] == 7).all(), "a padding row was written"


def test_fp8_block_matches_dequantized_torch():
    e, max_m, n, k = 3, 64, 256, 256
    counts = [9, 0, 30]
    a, w, mm = _problem(e, max_m, n, k, counts, seed=3)
    aq, a_s = fp8.quantize_group(a.reshape(-1, k))
    aq, a_s = aq.reshape(e, max_m, k), a_s.reshape(e, max_m, -1)
    wq, w_s = fp8.quantize_block(w)
    # activation scales MN-major (the layout dispatchers produce for DeepGEMM)
    a_s_mn = a_s.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.zeros(e, max_m, n, dtype=torch.bfloat16, device=DEV)
    masked_grouped_gemm(
        aq.to(DEV), a_s_mn.to(DEV), wq.to(DEV), w_s.to(DEV), out, mm.to(DEV), sum(counts), TileConfig(16, 64, 128)
    )
    ref = torch.einsum("emk,enk->emn", fp8.dequantize_group(aq, a_s), fp8.dequantize_block(wq, w_s))
    for i, c in enumerate(counts):
        torch.testing.assert_close(out[i, :c].float().cpu(), ref[i, :c], rtol=2e-2, atol=2e-2)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=64), st.sampled_from([16, 32, 64, 128]))
def test_tile_bound_covers_every_live_tile(counts, bm):
    live = sum(-(-c // bm) for c in counts)
    assert num_m_tiles(sum(counts), len(counts), bm) >= live


@pytest.mark.parametrize("rows", [1, 16, 64, 65, 4096])
@pytest.mark.parametrize("n", [16, 64, 96, 1536])
def test_default_tiles_fit_every_width(rows, n, monkeypatch):
    """The untuned tile of each batch size fits narrow GEMMs too, compiled or interpreted
    (session 49: 128 columns refused N = 64 on a GPU)."""
    import moehal.kernels.triton_grouped_gemm as gg

    for interp in (False, True):
        monkeypatch.setattr(gg, "interpreting", lambda i=interp: i)
        for is_fp8, k in ((False, 128), (False, 192), (True, 256)):
            cfg = default_config(rows, n, k, is_fp8)
            assert cfg.fits(n, k, is_fp8), (rows, n, k, is_fp8, interp, cfg)


def test_shape_errors_are_reported():
    a = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shapes do not match"):
        masked_grouped_gemm(a, None, w, None, torch.zeros(2, 64, 32), torch.zeros(2, dtype=torch.int32), 1)
    w = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K tiles must divide K"):
        cfg = TileConfig(16, 32, 256)
        masked_grouped_gemm(a, None, w, None, torch.zeros(2, 64, 32), torch.zeros(2, dtype=torch.int32), 1, cfg)


def test_binding_refuses_expert_slices_past_int32_offsets():
    """The masked kernels offset within an expert's slice in int32: a slice that spans more
    elements (300k rows at hidden 7168) is refused, not wrapped. Meta tensors: no memory."""
    from moehal.kernels.triton_grouped_gemm import INT32_SPAN, bind_masked_gemm_act, bind_masked_grouped_gemm

    e, k, n = 2, 7168, 256
    meta = dict(device="meta", dtype=torch.bfloat16)
    w = torch.empty(e, n, k, **meta)
    fits = INT32_SPAN // k  # rows whose slice ends at offset rows * k - 1 <= INT32_SPAN
    assert bind_masked_grouped_gemm(torch.empty(e, fits, k, **meta), None, w, None, torch.empty(e, fits, n, **meta), 8)
    with pytest.raises(ValueError, match=r"a \(2, \d+, 7168\).*int32"):
        a = torch.empty(e, fits + 1, k, **meta)
        bind_masked_grouped_gemm(a, None, w, None, torch.empty(e, fits + 1, n, **meta), 8)
    # a strided view spans as much as its strides say, whatever its shape
    wide = torch.empty_strided((e, 64, k), (64 * 2**26, 2**26, 1), **meta)
    with pytest.raises(ValueError, match="int32"):
        bind_masked_grouped_gemm(wide, None, w, None, torch.empty(e, 64, n, **meta), 8)
    # the fused GEMM1 checks its GEMM2 output buffer too
    w13 = torch.empty(e, 2 * n, k, **meta)
    y = torch.empty_strided((e, 16, k), (16 * 2**28, 2**28, 1), **meta)
    rows = torch.zeros(2, e, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"y \(2, 16, 7168\).*int32"):
        bind_masked_gemm_act(
            torch.empty(e, 16, k, **meta), w13, None, torch.empty(e, 16, n, **meta), rows,
            y, 8, TileConfig(16, 64, 64), activation=1, gated=True,
        )  # fmt: skip


def test_the_runners_triton_gemm_keeps_its_launch_only_while_shapes_and_weights_stay():
    """`cuda.deepgemm`'s Triton masked GEMM binds its launch once (host time of an eager decode
    step) and keeps it across calls with new activations, row counts and outputs; new weights
    or another input shape bind again. Every call gives the bits of the checked function."""
    import inspect

    from moehal_cuda.deepgemm_experts import triton_masked_gemm
    from moehal_cuda.gemm_choice import GemmChoice

    cfg = TileConfig(16, 32, 64, 1, 4, 1)
    run = triton_masked_gemm(GemmChoice("triton", cfg, 8), 40)
    n, k = 96, 128
    w_a, w_b = (torch.randn(4, n, k, generator=torch.Generator().manual_seed(s)).bfloat16().to(DEV) for s in (1, 2))
    calls = [(64, w_a, [3, 0, 17, 9]), (64, w_a, [0, 12, 1, 27]), (64, w_b, [5, 5, 5, 5]), (128, w_b, [30, 0, 0, 9])]
    launches = []
    for i, (max_m, w, counts) in enumerate(calls):
        a = torch.randn(4, max_m, k, generator=torch.Generator().manual_seed(10 + i)).bfloat16().to(DEV)
        mm = torch.tensor(counts, dtype=torch.int32, device=DEV)
        out = torch.zeros(4, max_m, n, dtype=torch.bfloat16, device=DEV)
        run(a, None, w, None, out, mm, 8)
        want = masked_grouped_gemm(a, None, w, None, torch.zeros_like(out), mm, 40, cfg)
        assert torch.equal(out, want), f"call {i}"
        launches.append(inspect.getclosurevars(run).nonlocals["launch"])
    assert launches[0] is launches[1], "kept across calls with new activations, counts and outputs"
    assert launches[2] is not launches[1] and launches[2].w is w_b, "bound again on new weights"
    assert launches[3] is not launches[2] and launches[3].shape[1] == 128, "bound again on another shape"


def test_bound_fused_gemm1_launch_takes_only_its_own_operands():
    """`MaskedGemmActLaunch.takes`: the runner keeps a fused GEMM1 launch only for the weights,
    bias and buffer shapes it was bound with."""
    from moehal.kernels.triton_grouped_gemm import bind_masked_gemm_act

    e, max_m, k, i, h = 4, 64, 128, 32, 48
    a = torch.zeros(e, max_m, k, dtype=torch.bfloat16, device=DEV)
    w13 = torch.zeros(e, 2 * i, k, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(e, max_m, i, dtype=torch.bfloat16, device=DEV)
    y = torch.zeros(e, max_m, h, dtype=torch.bfloat16, device=DEV)
    rows = torch.zeros(2, e, dtype=torch.int32, device=DEV)
    launch = bind_masked_gemm_act(a, w13, None, out, rows, y, 8, TileConfig(16, 32, 64), activation=1, gated=True)
    assert launch.takes(a.clone(), w13, None, out.clone(), y.clone())
    assert not launch.takes(a, w13.clone(), None, out, y)  # reloaded weights
    assert not launch.takes(a, w13, torch.zeros(e, 2 * i, device=DEV), out, y)  # a bias now
    assert not launch.takes(torch.zeros(e, 2 * max_m, k, dtype=torch.bfloat16, device=DEV), w13, None, out, y)
    assert not launch.takes(a, w13, None, out, torch.zeros(e, max_m, h + 16, dtype=torch.bfloat16, device=DEV))


def test_config_fits_rules():
    assert TileConfig(16, 64, 128).fits(1536, 2048, fp8=True)
    assert not TileConfig(16, 64, 256).fits(1536, 2048, fp8=True)  # straddles two scale groups
    assert not TileConfig(16, 64, 256).fits(1536, 768 + 64, fp8=False)
    assert TileConfig.from_dict(TileConfig(32, 64, 64, 8, 8, 4).as_dict()) == TileConfig(32, 64, 64, 8, 8, 4)


def test_chooser_reads_nearest_measured_token_count(tmp_path):
    key = entry_key(128, 1536, 2048, "bf16")
    cfg = TileConfig(16, 64, 128, 1, 4, 4).as_dict()
    table = {
        "meta": {"device": "Test GPU"},
        "entries": {
            key: {
                "1": {"use": "triton", "config": cfg, "us": {"deepgemm": 30.0, "triton": 20.0}},
                "64": {"use": "deepgemm", "config": cfg, "us": {"deepgemm": 30.0, "triton": 40.0}},
                "1024": {"use": "triton", "config": cfg, "us": {"deepgemm": 30.0, "triton": 29.5}},
            }
        },
    }
    path = table_path("Test GPU", tmp_path)
    path.write_text(json.dumps(table))
    ch = GemmChooser("Test GPU", tmp_path)
    assert ch.has_table
    first = ch.choose(128, 1536, 2048, "bf16", 4)
    assert first.triton and first.config == TileConfig.from_dict(cfg) and first.tuned_tokens == 1
    assert ch.choose(128, 1536, 2048, "bf16", 40).use == "deepgemm"
    assert ch.choose(128, 1536, 2048, "bf16", 1000).use == "deepgemm"  # a 2% win is inside the noise
    assert ch.choose(128, 2048, 768, "bf16", 4).use == "deepgemm"  # no entry for this GEMM
    assert not GemmChooser("Other GPU", tmp_path).has_table
    assert nearest([1, 16, 128], 3) == 1 and nearest([1, 16, 128], 5) == 16 and nearest([1, 16], 4) == 1


def test_chooser_gives_the_measured_triton_tile_whichever_kernel_won(tmp_path):
    """`GemmChooser.triton_tile`, for experts that always run the Triton GEMM: the nearest
    measured row's tile, also where DeepGEMM won there; None where nothing fits or is measured."""
    key = entry_key(128, 1536, 2048, "bf16")
    small, big = TileConfig(16, 64, 128, 1, 4, 4), TileConfig(128, 256, 64, 8, 8, 4)
    table = {
        "meta": {"device": "Test GPU"},
        "entries": {
            key: {
                "1": {"use": "triton", "config": small.as_dict(), "us": {"deepgemm": 30.0, "triton": 20.0}},
                "4096": {"use": "deepgemm", "config": big.as_dict(), "us": {"deepgemm": 30.0, "triton": 40.0}},
            },
            entry_key(8, 64, 2048, "bf16"): {"1": {"use": "triton", "config": big.as_dict()}},  # 256 > N
        },
    }
    table_path("Test GPU", tmp_path).write_text(json.dumps(table))
    ch = GemmChooser("Test GPU", tmp_path)
    assert ch.triton_tile(128, 1536, 2048, "bf16", 2) == small
    assert ch.triton_tile(128, 1536, 2048, "bf16", 3000) == big
    assert ch.triton_tile(128, 2048, 768, "bf16", 4) is None  # no entry for this GEMM
    assert ch.triton_tile(8, 64, 2048, "bf16", 1) is None  # the measured tile does not fit
    assert GemmChooser(None).triton_tile(128, 1536, 2048, "bf16", 1) is None


def test_chooser_reads_the_fused_tile_only_where_it_measured_faster(tmp_path):
    key = entry_key(128, 1536, 2048, "bf16")
    plain = TileConfig(16, 64, 256, 1, 4, 5).as_dict()
    fused = TileConfig(16, 32, 128, 1, 4, 5).as_dict()
    row = {"use": "triton", "config": plain, "us": {"deepgemm": 30.0, "triton": 20.0}}
    table = {
        "entries": {
            key: {
                "1": {**row, "fused": {"config": fused, "us": 17.0, "adapted_us": 21.0}},
                "4": {**row, "fused": {"config": fused, "us": 20.8, "adapted_us": 21.0}},  # inside the noise
                "16": row,
            }
        }
    }
    table_path("Test GPU", tmp_path).write_text(json.dumps(table))
    ch = GemmChooser("Test GPU", tmp_path)
    assert ch.choose(128, 1536, 2048, "bf16", 1).fused_config == TileConfig.from_dict(fused)
    assert ch.choose(128, 1536, 2048, "bf16", 4).fused_config is None
    assert ch.choose(128, 1536, 2048, "bf16", 16).fused_config is None


def test_chooser_fuses_prefill_gemm1_only_where_the_whole_layer_measured_faster(tmp_path):
    key = entry_key(128, 1536, 2048, "bf16")
    tile = TileConfig(128, 128, 64, 8, 8, 4)
    us = {"512": (486.0, 488.0), "2048": (646.0, 608.0), "4096": (860.0, 845.0)}  # -6%, then -1.7%: noise
    rec = {"config": tile.as_dict(), "layer_us": {t: {"current": c, "fused": f} for t, (c, f) in us.items()}}
    no_fit = {**rec, "config": TileConfig(128, 128, 512, 8, 8, 4).as_dict()}
    table = {"entries": {}, "prefill_fused": {key: rec, entry_key(128, 2048, 768, "bf16"): no_fit}}
    table_path("Test GPU", tmp_path).write_text(json.dumps(table))
    ch = GemmChooser("Test GPU", tmp_path)
    assert ch.prefill_fused(128, 1536, 2048, 2048) == tile
    assert ch.prefill_fused(128, 1536, 2048, 1500) == tile  # nearest measured count: 2048
    assert ch.prefill_fused(128, 1536, 2048, 4096) is None  # inside the noise
    assert ch.prefill_fused(128, 1536, 2048, 700) is None  # nearest: 512, slower fused
    assert ch.prefill_fused(128, 1536, 2048, 256) is None  # below the smallest measured count
    assert ch.prefill_fused(32, 4096, 7168, 2048) is None  # no record for this GEMM
    assert ch.prefill_fused(128, 2048, 768, 2048) is None  # its K tile does not divide K = 768
    assert GemmChooser("Other GPU", tmp_path).prefill_fused(128, 1536, 2048, 2048) is None


def test_shipped_prefill_fusion_records_are_measured_where_they_fuse():
    """Every shipped record names its measurement, and fuses only at counts measured faster."""
    for path in TUNED_DIR.glob("masked_gemm.*.json"):
        table = json.loads(path.read_text())
        for key, rec in table.get("prefill_fused", {}).items():
            assert rec["source"].startswith("docs/device-runs/") and key.endswith("dtype=bf16")
            ch = GemmChooser(table["meta"]["device"])
            e, n, k = (int(p.split("=")[1]) for p in key.split(",")[:3])
            for t, us in rec["layer_us"].items():
                fused = ch.prefill_fused(e, n, k, int(t)) is not None
                assert fused == (us["fused"] <= (1 - MIN_GAIN) * us["current"]), (path.name, key, t)


def test_fused_tuner_candidates_fit_the_fused_kernel():
    from moehal.kernels.triton_grouped_gemm import SMEM_BUDGET, fused_act_config, smem_bytes
    from moehal_cuda.tuning import fused_candidates

    for n13, k in ((1536, 2048), (4096, 7168), (28672, 4096)):
        cands = fused_candidates(n13, k)
        assert cands and {c.block_n for c in cands} >= {16, 32, 64}
        for c in cands:  # they fit as they are: the fused kernel runs exactly the measured tile
            assert c.fits(n13 // 2, k, False) and smem_bytes(c, 2, b_tiles=2) <= SMEM_BUDGET
            assert fused_act_config(c, k) == c


def test_tuner_candidates_fit_and_routing_counts_sum():
    for rows in (0.06, 1.0, 16.0, 64.0, 256.0):
        for n, k, q in ((1536, 2048, False), (2048, 768, False), (4096, 7168, True)):
            cands = candidate_configs(rows, n, k, q)
            assert cands and all(c.fits(n, k, q) for c in cands)
    counts = routing_counts(16, 128, 8, 3)
    assert len(counts) == 3 and all(int(c.sum()) == 128 and int(c.max()) <= 16 for c in counts)


def test_default_config_always_fits():
    for n, k in ((96, 128), (1536, 2048), (2048, 768), (7168, 2048)):
        for rows in (1, 30, 500):
            assert default_config(rows, n, k, False).fits(n, k, False)


def test_fused_act_tiles_fit_shared_memory():
    """The fused GEMM1 keeps two B tiles per stage: tuned plain tiles are shrunk to fit."""
    from moehal.kernels.triton_grouped_gemm import SMEM_BUDGET, fused_act_config, smem_bytes

    big = TileConfig(16, 64, 256, 1, 4, 5)  # tuned for Qwen3-30B-A3B w13 at 16 tokens on an H100
    assert smem_bytes(big, 2) <= SMEM_BUDGET < smem_bytes(big, 2, b_tiles=2)
    fused = fused_act_config(big, 2048)
    assert smem_bytes(fused, 2, b_tiles=2) <= SMEM_BUDGET
    assert (fused.block_m, fused.block_n, fused.block_k, fused.num_stages) == (16, 64, 128, 5)
    small = TileConfig(16, 32, 128, 1, 4, 4)  # fits as it is
    assert fused_act_config(small, 2048) == small


def test_shipped_tables_keep_every_token_row_in_order():
    """A re-tune of a few token counts (`--update`) once replaced a shape's whole row set, and a
    1024-token batch then ran the 8-token tile. Every shipped table keeps the full ladder."""
    from moehal_cuda.gemm_choice import TUNED_DIR
    from moehal_cuda.tuning import by_tokens

    assert by_tokens({"16": 1, "4": 2, "1024": 3, "2": 4}) == {"2": 4, "4": 2, "16": 1, "1024": 3}
    tables = sorted(TUNED_DIR.glob("masked_gemm.*.json"))
    assert tables, "no tuned tables shipped"
    for path in tables:
        for key, rows in json.loads(path.read_text())["entries"].items():
            counts = [int(t) for t in rows]
            assert counts == sorted(counts), f"{path.name} {key}: rows out of order"
            assert {1, 4, 16, 128, 1024, 4096} <= set(counts), f"{path.name} {key}: rows missing: {counts}"


@pytest.mark.parametrize(
    "name,content,flags",
    [
        ("README.md", "# my project\n", []),  # replaced by the table
        ("list.json", "[1, 2]\n", ["--update"]),  # json.load'ed and merged into
        ("settings.json", '{"name": "mine"}\n', ["--fused-only"]),
        ("missing.json", None, ["--fused-only"]),  # nothing to add to
    ],
)
def test_the_tuner_refuses_an_out_that_is_not_its_table_before_tuning(
    tmp_path, capsys, monkeypatch, name, content, flags
):
    """`python -m moehal_cuda.tuning --out X` replaced whatever X was, with no check that it was
    a table (security review, finding 8); now refused before anything is measured."""
    from moehal_cuda import tuning

    def no_run(*args, **kwargs):
        raise AssertionError("the tuning run started")

    monkeypatch.setattr(tuning.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "tune", no_run)
    monkeypatch.setattr(tuning, "tune_fused", no_run)
    out = tmp_path / name
    if content is not None:
        out.write_text(content)
    assert tuning.main(["--shapes", "tiny", "--tokens", "1", "--out", str(out), *flags]) == 2
    said = capsys.readouterr().out
    assert said.startswith(f"moehal_cuda.tuning: {out}") and ("not overwritten" in said or "there is none" in said)
    assert (out.read_text() == content) if content is not None else not out.exists()


def test_the_tuner_writes_an_earlier_table_in_one_step(tmp_path, monkeypatch):
    """An earlier table is accepted; the write goes through `replace_file`: a link planted at
    the old fixed `<out>.tmp` name is neither followed nor left as the table."""
    from moehal_cuda import tuning

    out = tmp_path / "tuned.json"
    out.write_text(json.dumps({"meta": {}, "entries": {}}))
    victim = tmp_path / "victim.txt"
    victim.write_text("data\n")
    (tmp_path / "tuned.json.tmp").symlink_to(victim)
    ran = []

    def tune(shapes, tokens, quants, out_path, *args, **kwargs):
        ran.append(out_path)
        tuning._write({"entries": {"k": {}}}, out_path)

    monkeypatch.setattr(tuning.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "tune", tune)
    assert tuning.main(["--shapes", "tiny", "--tokens", "1", "--out", str(out), "--update"]) == 0
    assert ran == [str(out)] and json.loads(out.read_text()) == {"entries": {"k": {}}}
    assert victim.read_text() == "data\n" and not out.is_symlink()


@pytest.mark.parametrize(
    "mode,cfg",
    [
        ("group", TileConfig(16, 128, 128, 1, 4, 1)),
        ("ue8m0", TileConfig(16, 32, 64, 1, 4, 1)),  # 4 programs per group: they meet to quantize it
        ("static", TileConfig(16, 64, 128, 1, 4, 1)),  # 2 programs per group
        ("static", TileConfig(16, 256, 128, 1, 4, 1)),  # two groups per program
    ],
)
def test_fp8_fused_gemm1_quantizes_gemm2_input_as_the_unfused_path(mode, cfg):
    """The fused FP8 GEMM1 + activation writes GEMM2's fp8 input and its 1x128 group scales (or
    the static scale in every slot) as GEMM1 -> bf16 -> SiLU-and-mul -> bf16 -> quantize does;
    rows past masked_m are left alone, rows live before and not now are zeroed, in the
    activation buffer and in GEMM2's output buffer."""
    from moehal.kernels.triton_fused_moe import _ACTS
    from moehal.kernels.triton_grouped_gemm import Fp8Operands, bind_masked_gemm_act

    e, max_m, k, i, h = 4, 64, 256, 256, 64
    g = torch.Generator().manual_seed(5)
    a = torch.randn(e, max_m, k, generator=g)
    w13 = torch.randn(e, 2 * i, k, generator=g) / k**0.5
    aq, a_s = fp8.quantize_group(a)
    wq, w_s = fp8.quantize_block(w13)
    a_s_mn = a_s.transpose(1, 2).contiguous().transpose(1, 2)  # MN-major, as dispatchers write it
    out = torch.full((e, max_m, i), 3.0).to(torch.float8_e4m3fn)
    out_s = torch.full((e, i // 128, max_m), 7.0).transpose(1, 2)  # MN-major too
    y = torch.full((e, max_m, h), 5.0, dtype=torch.bfloat16)
    before, counts = [10, 0, 40, 2], [3, 0, 17, 9]
    rows = torch.tensor([before, before], dtype=torch.int32)
    static = torch.tensor([0.02]) if mode == "static" else None
    ops = Fp8Operands(
        a_s_mn.to(DEV), w_s.to(DEV), out_s.to(DEV), mode == "ue8m0", None if static is None else static.to(DEV)
    )
    out, y, rows = out.to(DEV), y.to(DEV), rows.to(DEV)
    launch = bind_masked_gemm_act(
        aq.to(DEV), wq.to(DEV), None, out, rows, y, sum(counts), cfg, activation=_ACTS["silu"], gated=True, fp8=ops
    )
    assert launch.kw["SPLIT"] == max(1, 128 // cfg.block_n)
    launch(aq.to(DEV), out, rows, y, torch.tensor(counts, dtype=torch.int32, device=DEV), ops.a_scale, ops.out_scale)
    # split groups: the last program of each re-armed its arrival counter for the next launch
    if launch.kw["SPLIT"] > 1:
        assert not launch.fp8_args[3].any()
    # the unfused path's numbers: GEMM1 in fp32 -> bf16, the activation in fp32 -> bf16, quantized
    hh = torch.einsum("emk,enk->emn", fp8.dequantize_group(aq, a_s), fp8.dequantize_block(wq, w_s)).bfloat16().float()
    act = (torch.nn.functional.silu(hh[..., :i]) * hh[..., i:]).bfloat16().float()
    if static is None:
        want_q, want_s = fp8.quantize_group(act, ue8m0=mode == "ue8m0")
    else:
        want_q, _ = fp8.quantize_tensor(act, static)
        want_s = static.expand(e, max_m, i // 128)
    out, out_s, y = out.cpu(), ops.out_scale.cpu(), y.cpu()
    for x, c in enumerate(counts):
        got = fp8.dequantize_group(out[x, :c], out_s[x, :c])
        want = fp8.dequantize_group(want_q[x, :c], want_s[x, :c])
        torch.testing.assert_close(out_s[x, :c], want_s[x, :c], rtol=1e-2, atol=0)
        # one e4m3 step (2^-3 relative) where a bf16 rounding of GEMM1 differs in the last bit
        torch.testing.assert_close(got, want, rtol=0.13, atol=1e-3 * float(act.abs().max()))
        stale = slice(c, max(c, before[x]))
        assert (out[x, stale].float() == 0).all() and (y[x, stale].float() == 0).all(), f"expert {x}: stale rows"
        rest = slice(max(c, before[x]), max_m)
        assert (out[x, rest].float() == 3).all() and (y[x, rest].float() == 5).all(), f"expert {x}: padding written"
        assert (out_s[x, c:] == 7).all(), f"expert {x}: scales of rows past masked_m written"


def test_chooser_fuses_fp8_decode_only_where_the_whole_layer_measured_faster(tmp_path):
    """`GemmChooser.decode_fused`: the nearest measured count (log scale) decides; a win inside
    MIN_GAIN is no win; no recorded tile means the plain GEMM1 tile adapted."""
    key = entry_key(128, 1536, 2048, "fp8_block")
    tile = TileConfig(16, 32, 128, 1, 4, 5)
    layer_us = {
        "1": {"current": 24.6, "fused": 22.8, "config": tile.as_dict()},  # -7.3%
        "2": {"current": 37.6, "fused": 36.2},  # -3.7%, the adapted tile
        "4": {"current": 47.6, "fused": 47.4, "config": tile.as_dict()},  # -0.4%: noise
        "16": {"current": 123.4, "fused": 120.9, "config": TileConfig(16, 48, 128).as_dict()},  # no whole group
    }
    table = {"entries": {}, "decode_fused": {key: {"source": "test", "layer_us": layer_us}}}
    table_path("Test GPU", tmp_path).write_text(json.dumps(table))
    ch = GemmChooser("Test GPU", tmp_path)
    assert ch.decode_fused(128, 1536, 2048, "fp8_block", 1) == (True, tile)
    assert ch.decode_fused(128, 1536, 2048, "fp8_block", 2) == (True, None)
    assert ch.decode_fused(128, 1536, 2048, "fp8_block", 3) == (False, None)  # nearest: 4
    assert ch.decode_fused(128, 1536, 2048, "fp8_block", 16) == (False, None)
    assert ch.decode_fused(128, 2048, 768, "fp8_block", 1) == (False, None)  # no record for this GEMM1
    assert GemmChooser("Other GPU", tmp_path).decode_fused(128, 1536, 2048, "fp8_block", 1) == (False, None)


def test_decode_fused_records_come_from_bench_ab_logs():
    """`tools/decode_fused_records.py`: per shape and count, the unfused time and the fastest
    fused variant with its tile (none for the adapted tile), keyed by the fp8 GEMM1 shape."""
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).parents[2] / "tools" / "decode_fused_records.py"
    spec = importlib.util.spec_from_file_location("decode_fused_records", tool)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    log = """NVIDIA H200
== qwen3_30b_a3b fp8_block T=2
  fp8-unfused               37.6 us    +0.0%  (38.1, 37.6, 37.4)
  fp8-fused                 36.2 us    -3.7%  (36.2, 35.9, 36.2)
  fp8-fused=16/32/128/4/5      36.4 us    -3.6%  (36.2, 36.7, 36.4)
== qwen3_30b_a3b fp8_block T=1
  fp8-unfused               24.6 us    +0.0%  (24.6, 24.6, 24.3)
  fp8-fused=16/32/128/4/5      22.8 us    -7.3%  (22.8, 22.6, 23.2)
== mixtral_8x7b bf16 T=1
  shipped                   99.0 us    +0.0%  (99.0)
"""
    recs = mod.records(mod.parse(log), "the log")
    assert list(recs) == ["E=128,N=1536,K=2048,dtype=fp8_block"]
    rec = recs["E=128,N=1536,K=2048,dtype=fp8_block"]
    assert rec["source"] == "the log" and list(rec["layer_us"]) == ["1", "2"]
    assert rec["layer_us"]["2"] == {"current": 37.6, "fused": 36.2}
    tile = TileConfig(16, 32, 128, 1, 4, 5).as_dict()
    assert rec["layer_us"]["1"] == {"current": 24.6, "fused": 22.8, "config": tile}


def test_a_table_tuned_outside_the_package_is_registered_by_path(tmp_path, monkeypatch):
    """A wheel's users tune into a file of their own: `register_table` points the device's
    chooser at it (the shipped table's folder is site-packages)."""
    from moehal_cuda import gemm_choice

    monkeypatch.setattr(gemm_choice, "_REGISTERED", {})
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4}
    key = gemm_choice.entry_key(8, 256, 512, "bf16")
    mine = tmp_path / "my_h200.json"
    row = {"use": "triton", "config": cfg, "us": {"deepgemm": 30.0, "triton": 20.0}}
    mine.write_text(json.dumps({"meta": {}, "entries": {key: {"1": row}}}))
    assert not GemmChooser("Tuned Here GPU").has_table
    gemm_choice.register_table("Tuned Here GPU", mine)
    assert gemm_choice.table_path("Tuned Here GPU") == mine.resolve()
    assert GemmChooser("Tuned Here GPU").choose(8, 256, 512, "bf16", 1).triton
    with pytest.raises(FileNotFoundError):
        gemm_choice.register_table("Tuned Here GPU", tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a masked-GEMM tuning table"):
        gemm_choice.register_table("Tuned Here GPU", tmp_path / "bad.json")
