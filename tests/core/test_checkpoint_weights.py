"""`moehal.from_per_expert`: the canonical weights from a checkpoint that stores each expert's
gate, up and down projections apart (HF and vLLM layouts), against the canonical tensors they
were cut from."""

from __future__ import annotations

import moehal
import pytest
import torch

E, H, INTER = 4, 256, 128


def _float_weights(inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * inter, H, generator=g) / 16, torch.randn(E, H, inter, generator=g) / 11


def _cut(t: torch.Tensor, inter_rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [x[:inter_rows] for x in t], [x[inter_rows:] for x in t]


def test_bf16_experts_stack_into_w13_gate_then_up_and_run_as_the_canonical_layer():
    w13, w2 = (t.bfloat16() for t in _float_weights())
    gate, up = _cut(w13, INTER)
    b13 = torch.randn(E, 2 * INTER).bfloat16()
    gb, ub = _cut(b13, INTER)
    got = moehal.from_per_expert(gate, up, list(w2), gate_bias=gb, up_bias=ub, down_bias=list(torch.zeros(E, H)))
    assert torch.equal(got.w13, w13) and torch.equal(got.w2, w2) and torch.equal(got.w13_bias, b13)
    cfg = moehal.MoEConfig(E, 2, H, INTER, has_w13_bias=True, has_w2_bias=True)
    a, b = (moehal.MoELayer(cfg, device="cpu", backend="reference") for _ in range(2))
    a.load_weights(got)
    b.load_weights(w13=w13, w2=w2, w13_bias=b13, w2_bias=torch.zeros(E, H))
    x, ids, w = torch.randn(3, H).bfloat16(), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    assert torch.equal(a(x, ids, w), b(x, ids, w))


def test_fp8_block_scales_stack_gate_then_up():
    cfg = moehal.MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=INTER)
    q = moehal.quantize_weights(cfg, "fp8_block", *_float_weights())
    gate, up = _cut(q.w13, INTER)
    gs, us = _cut(q.w13_scale, INTER // 128)  # DeepSeek's weight_scale_inv per projection: [INTER/128, H/128]
    got = moehal.from_per_expert(gate, up, list(q.w2), gate_scale=gs, up_scale=us, down_scale=list(q.w2_scale))
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(getattr(got, name).float(), getattr(q, name).float()), name


def test_what_w13_cannot_hold_is_refused_with_the_way_out():
    inter = 192  # 1.5 blocks of 128 rows: gate's last block and up's first would be one
    gate = [torch.zeros(inter, H, dtype=torch.float8_e4m3fn)] * E
    blocks = [torch.ones(2, H // 128)] * E
    with pytest.raises(moehal.WeightError, match="straddle the two halves"):
        moehal.from_per_expert(gate, gate, [torch.zeros(H, inter)] * E, gate_scale=blocks, up_scale=blocks)
    one, other = [torch.tensor(0.5)] * E, [torch.tensor(0.25)] * E  # fp8_tensor: one scale per expert
    w = [torch.zeros(INTER, H)] * E
    with pytest.raises(moehal.WeightError, match="expert 0: gate_scale 0.5 and up_scale 0.25 differ"):
        moehal.from_per_expert(w, w, [torch.zeros(H, INTER)] * E, gate_scale=one, up_scale=other)
    down = [torch.zeros(H, INTER)] * E
    assert moehal.from_per_expert(w, w, down, gate_scale=one, up_scale=one).w13_scale.shape == (E,)
    with pytest.raises(moehal.WeightError, match="gate has 3 experts, down has 4"):
        moehal.from_per_expert(w[:3], w, [torch.zeros(H, INTER)] * E)
    with pytest.raises(moehal.WeightError, match="gate_scale given without up_scale"):
        moehal.from_per_expert(w, w, [torch.zeros(H, INTER)] * E, gate_scale=one)
    with pytest.raises(moehal.WeightError, match="gate_bias given for a non-gated MLP"):
        moehal.from_per_expert(None, w, down, gate_bias=[torch.zeros(INTER)] * E, up_bias=[torch.zeros(INTER)] * E)
    assert moehal.from_per_expert(None, w, down).w13.shape == (E, INTER, H)
