"""DeepGEMM's contiguous GEMMs on the segments' ends (`use_psum_layout`), on any device.

A stand-in deep_gemm module computes as DeepGEMM's SM90 kernels walk each layout (its
`deep_gemm/include/deep_gemm/scheduler/gemm.cuh`): with `m_indices`, every 128-row tile of the
buffer, on the weights of the expert its first row names (expert 0 for a -1, the unused tail
included, as its bf16 kernel does); with the psum layout, expert g's tiles from
align(psum[g-1], 128) up to its segment end psum[g], and no tile past the last one. The runner
must hand it the segments' ends, and both layouts must give the reference's numbers."""

from __future__ import annotations

import inspect

import pytest
import torch
from moehal.config import MoEConfig
from moehal.formats import ActivationFormat, Layout
from moehal.hardware import detect
from moehal.interfaces import BuildRequest
from moehal.quant import QuantScheme
from moehal.reference.dispatcher import ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts
from moehal.routing import TopK
from moehal.weights import quantize_weights
from moehal_cuda import deepgemm_experts as dge
from moehal_cuda.dispatch import CudaPermuteDispatcher

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TILE = 128


class _DeepGemm:
    """deep_gemm's bf16 contiguous GEMM, in torch; `calls` records each call's layout."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.tiles = 0  # 128-row tiles computed, over all calls

    @staticmethod
    def get_mk_alignment_for_contiguous_layout() -> int:
        return TILE

    def m_grouped_bf16_gemm_nt_masked(self, *args, **kwargs) -> None:
        raise AssertionError("these tests run the contiguous layout only")

    def m_grouped_bf16_gemm_nt_contiguous(
        self, a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False, ensure_zero_padding=True,
        expected_m_for_psum_layout=None,
    ) -> None:  # fmt: skip
        self.calls.append("psum" if use_psum_layout else "m_indices")
        if use_psum_layout:
            start = 0
            for g, end in enumerate(grouped_layout.tolist()):
                for t0 in range(start, end, TILE):
                    d[t0 : t0 + TILE] = (a[t0 : t0 + TILE].float() @ b[g].float().t()).to(d.dtype)
                    self.tiles += 1
                start = -(-end // TILE) * TILE
            return
        for t0 in range(0, a.shape[0], TILE):
            e = max(0, int(grouped_layout[t0]))
            d[t0 : t0 + TILE] = (a[t0 : t0 + TILE].float() @ b[e].float().t()).to(d.dtype)
            self.tiles += 1


class _OlderDeepGemm(_DeepGemm):
    """A release whose contiguous GEMM takes `m_indices` only."""

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, grouped_layout) -> None:
        super().m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout)


def _runner(dg, monkeypatch, cfg, quant, fmt):
    monkeypatch.setattr(dge, "import_deep_gemm", lambda: dg)
    req = BuildRequest(cfg, quant, detect(DEV))
    return dge.DeepGemmExpertsRunner(req, fmt, dge.DeepGemmOps(False, False, replay_graphs=False)), req


def _bf16_pipeline(monkeypatch, seed, **cfg_changes):
    """The permute and the DeepGEMM runner (on the stand-in) of a bf16 contiguous layer with
    random weights: (stand-in, experts, dispatcher, generator)."""
    cfg = MoEConfig(**{**dict(num_experts=8, top_k=3, hidden_size=256, intermediate_size=128, max_tokens=160),
                       **cfg_changes})  # fmt: skip
    quant = QuantScheme.parse("bf16")
    fmt = ActivationFormat(Layout.CONTIGUOUS, cfg.dtype, row_alignment=TILE)
    dg = _DeepGemm()
    ex, req = _runner(dg, monkeypatch, cfg, quant, fmt)
    g = torch.Generator().manual_seed(seed)
    e = cfg.num_local_experts
    w13, w2 = torch.randn(e, cfg.w13_rows, 256, generator=g), torch.randn(e, 256, 128, generator=g)
    ex.load(quantize_weights(cfg, quant, w13, w2).to(DEV))
    return dg, ex, CudaPermuteDispatcher().build(req, fmt), g


@pytest.mark.parametrize("psum_layout", [True, False])
def test_contiguous_gemms_on_segment_ends_match_the_reference(psum_layout, monkeypatch):
    monkeypatch.setattr(dge.DeepGemmOps, "psum_layout", psum_layout)
    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=256, intermediate_size=128, max_tokens=160, has_w2_bias=True)
    quant = QuantScheme.parse("bf16")
    fmt = ActivationFormat(Layout.CONTIGUOUS, cfg.dtype, row_alignment=TILE)
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(8, cfg.w13_rows, 256, generator=g) / 16
    w2 = torch.randn(8, 256, 128, generator=g) / 11
    weights = quantize_weights(cfg, quant, w13, w2, w2_bias=torch.randn(8, 256, generator=g) * 0.1).to(DEV)
    dg = _DeepGemm()
    ex, req = _runner(dg, monkeypatch, cfg, quant, fmt)
    assert ex.ops.takes_psum is psum_layout
    ex.load(weights)
    disp = CudaPermuteDispatcher().build(req, fmt)
    rdisp, rex = ReferenceDispatcher().build(req, fmt), ReferenceExperts().build(req, fmt)
    rex.load(weights)
    # 150 tokens: expert 5's rows pass a 128-row tile; 1 token: most experts have none
    for t in (150, 1, 17):
        x = torch.randn(t, 256, generator=g).bfloat16().to(DEV)
        ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(t)]).int().to(DEV)
        ids[:, 0] = torch.where(ids[:, 1:].eq(5).any(1), ids[:, 0], 5)  # expert 5 in every token
        topk = TopK(ids, (torch.rand(t, 3, generator=g) + 0.1).to(DEV))
        inp, handle = disp.dispatch(x, topk)
        tiles = dg.tiles
        y = disp.combine(ex.apply(inp), handle)
        rinp, rhandle = rdisp.dispatch(x, topk)
        ry = rdisp.combine(rex.apply(rinp), rhandle)
        err = ((y.float() - ry.float()).abs().max() / ry.float().abs().max()).item()
        assert err < 2e-2, f"{t} tokens: rel err {err:.4f}"
        # the psum layout computes the segments' tiles only; m_indices every tile of the call's rows
        live_tiles = sum(-(-int(n) // TILE) for n in inp.counts.tolist())
        want = live_tiles if psum_layout else inp.hidden.shape[0] // TILE
        assert dg.tiles - tiles == 2 * want
    assert set(dg.calls) == {"psum" if psum_layout else "m_indices"}


def test_a_batch_without_tokens_calls_no_gemm(monkeypatch):
    """No slots, no rows: the runner returns at once. (Before, 0 tokens made 128 rows of padding
    whose segment ends came from uninitialized counts, and DeepGEMM, reading them, died of an
    illegal instruction on an H200: docs/device-runs/2026-11-25-session33.)"""
    dg, ex, disp, g = _bf16_pipeline(monkeypatch, 4)
    for t in (0, 5, 0):
        x = torch.randn(t, 256, generator=g).bfloat16().to(DEV)
        ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(t)] or [torch.zeros(0, 3)]).int()
        inp, handle = disp.dispatch(x, TopK(ids.view(t, 3).to(DEV), torch.rand(t, 3, generator=g).to(DEV)))
        calls = len(dg.calls)
        y = disp.combine(ex.apply(inp), handle)
        assert y.shape == (t, 256)
        if t == 0:
            assert inp.hidden.shape[0] == 0 and len(dg.calls) == calls
            assert inp.counts.tolist() == [0] * 8 and inp.segment_start.tolist() == [0] * 8
        else:
            assert len(dg.calls) == calls + 2


def test_an_ep_rank_without_local_slots_gets_rows_and_no_segments(monkeypatch):
    """An expert-parallel rank whose batch routes every slot to other ranks: the contiguous
    layout has rows (sized on the host from the slot count), every row reads -1, every segment
    is empty, and DeepGEMM gets segment ends that are all 0. No tile is computed, and the
    output is all zeros (conformance's `shapes/.../no_local_slots` runs this on the GPU)."""
    dg, ex, disp, g = _bf16_pipeline(monkeypatch, 5, num_experts=16, ep_size=2, ep_rank=1)  # rank 1: experts 8-15
    t = 9
    x = torch.randn(t, 256, generator=g).bfloat16().to(DEV)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(t)]).int().to(DEV)  # rank 0's experts
    inp, handle = disp.dispatch(x, TopK(ids, (torch.rand(t, 3, generator=g) + 0.1).to(DEV)))
    assert inp.hidden.shape[0] > 0
    assert inp.counts.tolist() == [0] * 8 and inp.segment_start.tolist() == [0] * 8
    assert inp.row_expert.tolist() == [-1] * inp.hidden.shape[0]
    tiles = dg.tiles
    y = disp.combine(ex.apply(inp), handle)
    assert dg.calls[-2:] == ["psum", "psum"] and dg.tiles == tiles
    assert torch.equal(y.cpu(), torch.zeros(t, 256, dtype=torch.bfloat16))


def test_buffers_first_allocated_in_inference_mode_take_calls_outside_it(monkeypatch):
    """Engines serve under `torch.inference_mode()`. The segments' ends and the workspaces are
    kept across calls; allocated as inference tensors there, the next call under `no_grad`
    raised at the in-place add of the segment ends. They are normal tensors now."""
    from moehal.kernels import triton_permute as tp

    tp.release_workspaces(DEV)
    dg, ex, disp, g = _bf16_pipeline(monkeypatch, 6)
    x = torch.randn(5, 256, generator=g).bfloat16().to(DEV)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(5)]).int().to(DEV)
    topk = TopK(ids, torch.rand(5, 3, generator=g).to(DEV))
    with torch.inference_mode():
        inp, handle = disp.dispatch(x, topk)
        served = disp.combine(ex.apply(inp), handle)
    assert dg.calls[-2:] == ["psum", "psum"]
    with torch.no_grad():
        inp, handle = disp.dispatch(x, topk)
        assert torch.equal(disp.combine(ex.apply(inp), handle), served)
    assert not any(t.is_inference() for t in tp._SCRATCH.values())


def test_releases_without_the_psum_layout_and_sm100_keep_m_indices(monkeypatch):
    older = _OlderDeepGemm()
    monkeypatch.setattr(dge, "import_deep_gemm", lambda: older)
    assert "use_psum_layout" not in inspect.signature(older.m_grouped_bf16_gemm_nt_contiguous).parameters
    assert not dge.DeepGemmOps(False, False, replay_graphs=False).takes_psum
    monkeypatch.setattr(dge, "import_deep_gemm", lambda: _DeepGemm())
    assert dge.DeepGemmOps(False, False, replay_graphs=False).takes_psum
    assert not dge.DeepGemmOps(False, True, replay_graphs=False).takes_psum  # SM100: never run there


class _RecordingFp8DeepGemm:
    """deep_gemm's fp8 grouped GEMMs, recording each call's keyword arguments only."""

    def __init__(self) -> None:
        self.kwargs: list[tuple[str, dict]] = []

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m, **kwargs) -> None:
        self.kwargs.append(("masked", kwargs))

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, grouped_layout, **kwargs) -> None:
        self.kwargs.append(("contiguous", kwargs))


@pytest.mark.parametrize("sm100", [True, False])
def test_sm100_fp8_gemms_ask_for_the_packed_ue8m0_recipe(monkeypatch, sm100):
    """On SM100 the weight scales are transformed into packed UE8M0 ints (INT32 SFB), for which
    DeepGEMM's recipe is (1, 1, 128); (1, 128, 128) is its legacy one, for FP32 SFB. SM90 keeps
    DeepGEMM's default recipe: no `recipe` is passed there."""
    dg = _RecordingFp8DeepGemm()
    monkeypatch.setattr(dge, "import_deep_gemm", lambda: dg)
    ops = dge.DeepGemmOps(True, sm100, replay_graphs=False)
    a, w = torch.zeros(2, 128, 128), torch.zeros(2, 256, 128)
    ops.masked(a, None, w, None, torch.zeros(2, 128, 256), torch.tensor([1, 2], dtype=torch.int32), 2)
    ops.contiguous(a[0], None, w, None, torch.zeros(128, 256), torch.zeros(128, dtype=torch.int32))
    want = {"recipe": (1, 1, 128)} if sm100 else {}
    assert dg.kwargs == [("masked", want), ("contiguous", want)]
