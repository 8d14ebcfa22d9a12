"""DeepGEMM calls replayed from one-kernel CUDA graphs (`moehal.graphs.LaunchMemo` in
`DeepGemmOps`, with `graphs.MEMO_ENABLED` on) give the bits of direct calls, with new contents
and row counts at every call."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]


def _ops():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the bf16 DeepGEMM calls here are SM90's")
    try:
        from moehal_cuda.deepgemm_experts import DeepGemmOps
        from moehal_cuda.support import import_deep_gemm

        import_deep_gemm()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"deep_gemm not importable: {exc}")
    return DeepGemmOps(False, False), DeepGemmOps(False, False, replay_graphs=False)


@pytest.fixture(autouse=True)
def _memo_on(monkeypatch):
    from moehal import graphs

    monkeypatch.setattr(graphs, "MEMO_ENABLED", True)  # the default; a test may have switched it


def test_masked_gemm_replays_match_direct_calls():
    memo, direct = _ops()
    g = torch.Generator(device="cuda").manual_seed(0)
    e, m, n, k = 4, 64, 256, 512
    a = torch.empty(e, m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", generator=g).bfloat16()
    d1 = torch.zeros(e, m, n, device="cuda", dtype=torch.bfloat16)
    d2 = torch.zeros_like(d1)
    mm = torch.empty(e, device="cuda", dtype=torch.int32)
    for _ in range(5):
        a.copy_(torch.randn(e, m, k, device="cuda", generator=g))
        mm.copy_(torch.randint(0, m + 1, (e,), device="cuda", generator=g))
        memo.masked(a, None, w, None, d1, mm, 32)
        direct.masked(a, None, w, None, d2, mm, 32)
        for i, rows in enumerate(mm.tolist()):
            assert torch.equal(d1[i, :rows], d2[i, :rows])
    assert memo.memos is not None and memo.memos[0].off_reason is None
    assert memo.memos[0].replays == 3  # calls 1-2 direct (the second also captures), 3-5 replay


def test_contiguous_gemm_replays_match_direct_calls():
    memo, direct = _ops()
    g = torch.Generator(device="cuda").manual_seed(1)
    e, n, k, rows = 4, 256, 512, 512
    a = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", generator=g).bfloat16()
    d1 = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
    d2 = torch.zeros_like(d1)
    layout = torch.empty(rows, device="cuda", dtype=torch.int32)
    for _ in range(5):
        a.copy_(torch.randn(rows, k, device="cuda", generator=g))
        # 128-row blocks, each one expert's or padding (-1): DeepGEMM's contiguous layout
        block = torch.randint(-1, e, (rows // 128,), device="cuda", generator=g, dtype=torch.int32)
        layout.copy_(block.repeat_interleave(128))
        memo.contiguous(a, None, w, None, d1, layout)
        direct.contiguous(a, None, w, None, d2, layout)
        keep = layout >= 0
        assert torch.equal(d1[keep], d2[keep])
    assert memo.memos is not None and memo.memos[1].replays == 3


@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_a_layers_two_deepgemm_calls_replay_with_the_bits_of_direct_calls(quant, monkeypatch, registry):
    """In a layer GEMM1 and GEMM2 share the masked memo and take turns: both are captured on
    the second forward and replayed from the third (session 16: the earlier "twice in a row"
    rule never captured them, so replays only ever cost their signatures)."""
    import moehal
    from moehal import graphs
    from moehal_cuda.gemm_choice import DEEPGEMM, GemmChooser

    _ops()  # skips where DeepGEMM's SM90 calls cannot run
    monkeypatch.setattr(GemmChooser, "choose", lambda *a, **k: DEEPGEMM)  # no tuned Triton tiles
    monkeypatch.setattr(GemmChooser, "prefill_fused", lambda *a, **k: None)
    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=128)
    g = torch.Generator(device="cuda").manual_seed(7)
    w13 = torch.randn(16, cfg.w13_rows, 512, device="cuda", generator=g) / 512**0.5
    w2 = torch.randn(16, 512, 256, device="cuda", generator=g) / 256**0.5
    layer = moehal.MoELayer(cfg, quant, backend="cuda", device="cuda", registry=registry)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13, w2))
    ops = getattr(layer._experts, "ops", None)
    if ops is None or ops.memos is None:
        pytest.skip(f"{layer.plan.pipeline.name} makes no memoized DeepGEMM calls")
    tokens = 32
    x = torch.empty(tokens, 512, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(tokens, 4, device="cuda", dtype=torch.int32)
    wts = torch.empty(tokens, 4, device="cuda")
    batches = []
    for _ in range(4):  # new contents and routing at every forward, in the same tensors
        scores = torch.rand(tokens, 16, device="cuda", generator=g)
        top, idx = scores.topk(4, dim=-1)
        batches.append((torch.randn(tokens, 512, device="cuda", generator=g).bfloat16(), idx.int(), top))

    def run() -> list[torch.Tensor]:
        outs = []
        for bx, bi, bw in batches:
            x.copy_(bx), ids.copy_(bi), wts.copy_(bw)
            outs.append(layer(x, ids, wts).clone())
        return outs

    monkeypatch.setattr(graphs, "MEMO_ENABLED", False)
    want = run()
    monkeypatch.setattr(graphs, "MEMO_ENABLED", True)
    got = run()
    torch.cuda.synchronize()
    memo = ops.memos[0]
    assert memo.off_reason is None
    assert memo.replays == 4, f"{layer.plan.pipeline.name}: {memo.replays} replays"  # forwards 3 and 4
    for a, b in zip(got, want):
        assert torch.equal(a, b)
