"""`moehal.from_per_expert`: the canonical weights from a checkpoint that stores each expert's
gate, up and down projections apart (HF and vLLM layouts), against the canonical tensors they
were cut from."""

from __future__ import annotations

import os
import subprocess
import sys

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
    with pytest.raises(moehal.WeightError, match="expert 0: gate and up scales 0.5 and 0.25 differ.*only torch.float8"):
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_tensor_gate_and_up_scales_that_differ_share_the_larger():
    """ModelOpt and compressed-tensors fp8 checkpoints store one scale for w1 and one for w3;
    w13 holds one per expert. The half with the smaller scale is requantized to the larger, as
    vLLM does, keeping the checkpoint's activation scales (before: refused, with advice to
    requantize through quantize_weights, whose placeholder activation scales clip real inputs)."""
    g = torch.Generator().manual_seed(3)
    gate_f = [torch.randn(INTER, H, generator=g) / 16 for _ in range(E)]
    up_f = [torch.randn(INTER, H, generator=g) / 40 for _ in range(E)]  # a finer scale than gate's
    gate, gs = zip(*(moehal.quant.fp8.quantize_tensor(w) for w in gate_f), strict=True)
    up, us = zip(*(moehal.quant.fp8.quantize_tensor(w) for w in up_f), strict=True)
    down = [torch.zeros(H, INTER, dtype=torch.float8_e4m3fn)] * E
    got = moehal.from_per_expert(gate, up, down, gate_scale=gs, up_scale=us, down_scale=[torch.tensor(1.0)] * E)
    assert torch.equal(got.w13_scale, torch.maximum(torch.stack(gs), torch.stack(us)).float())
    assert torch.equal(got.w13[:, :INTER], torch.stack(gate))  # the coarser half stays as it was
    want = torch.stack([torch.cat([a.float() * sa, b.float() * sb]) for a, sa, b, sb in zip(gate, gs, up, us)])
    deq = got.w13.float() * got.w13_scale[:, None, None]
    assert _rel(deq, want) < 0.04  # one more e4m3 rounding of the finer half
    assert _rel(deq[:, :INTER], want[:, :INTER]) == 0


def test_nvfp4_global_scales_per_projection_are_reconciled_and_reciprocals_refused():
    """ModelOpt NVFP4: `weight_scale_2` = amax / (448 * 6), dequantized as e2m1 * block *
    weight_scale_2; moehal's global scale divides, so it is 1 / weight_scale_2. w1 and w3 often
    differ (vLLM #54974): the smaller global wins and the other half's block scales shrink."""
    nvfp4 = moehal.quant.nvfp4
    g = torch.Generator().manual_seed(4)
    halves = [[torch.randn(INTER, H, generator=g) * s for _ in range(E)] for s in (0.05, 0.02)]
    packed, blocks, ws2 = [], [], []  # per half, as ModelOpt stores them
    for ws in halves:
        amax = torch.stack([w.abs().amax() for w in ws])
        scale_2 = amax / (448 * 6)
        q = [nvfp4.quantize(w, 1 / s2) for w, s2 in zip(ws, scale_2)]
        packed.append([a for a, _ in q]), blocks.append([b for _, b in q]), ws2.append(scale_2)
    want = torch.stack([
        torch.cat([nvfp4.block_values(packed[h][e], blocks[h][e]) * ws2[h][e] for h in (0, 1)]) for e in range(E)
    ])  # fmt: skip
    down = [torch.zeros(H, INTER // 2, dtype=torch.uint8)] * E
    down_s = [torch.ones(H, INTER // 16).to(torch.float8_e4m3fn)] * E
    got = moehal.from_per_expert(
        packed[0], packed[1], down, gate_scale=blocks[0], up_scale=blocks[1], down_scale=down_s,
        gate_global_scale=list(1 / ws2[0]), up_global_scale=list(1 / ws2[1]), down_global_scale=[torch.tensor(1e3)] * E,
    )  # fmt: skip
    assert torch.allclose(got.w13_global_scale, torch.minimum(1 / ws2[0], 1 / ws2[1]))
    deq = nvfp4.dequantize(got.w13, got.w13_scale, got.w13_global_scale[:, None, None])
    assert _rel(deq, want) < 0.03  # the rescaled block scales rounded again to e4m3
    cfg = moehal.MoEConfig(E, 2, H, INTER)
    layer = moehal.MoELayer(cfg, device="cpu", backend="reference", quant="nvfp4")
    a_scale = dict(a13_scale=torch.tensor(100.0), a2_scale=torch.tensor(100.0))
    as_stored = got.replace(w13_global_scale=1 / got.w13_global_scale, **a_scale)  # weight_scale_2 itself
    with pytest.raises(moehal.WeightError, match="1 / weight_scale_2"):
        layer.load_weights(as_stored)
    with pytest.raises(moehal.WeightError, match="per projection"):
        moehal.from_per_expert(packed[0], packed[1], down, w13_global_scale=got.w13_global_scale)


def test_dequantize_weights_names_the_missing_scales():
    q = moehal.ExpertWeights(torch.zeros(E, 2, H, dtype=torch.float8_e4m3fn), torch.zeros(E, H, 1))
    with pytest.raises(moehal.WeightError, match="missing: w13_scale, w2_scale"):
        moehal.dequantize_weights(q, "fp8_block")


def test_what_does_not_stack_is_a_weight_error():
    for args in (
        ([], [], []),
        ([torch.zeros(16, 32), torch.zeros(16, 30)], [torch.zeros(16, 32)] * 2, [torch.zeros(32, 16)] * 2),
    ):
        with pytest.raises(moehal.WeightError, match="do not stack into w13 and w2"):
            moehal.from_per_expert(*args)


def test_gate_and_up_of_other_dtypes_are_refused_not_promoted():
    w = [torch.zeros(INTER, H)] * E
    with pytest.raises(moehal.WeightError, match="expert 0's parts are torch.float32"):
        moehal.from_per_expert(w, [t.bfloat16() for t in w], [torch.zeros(H, INTER)] * E)


def _peak_bytes(setup: str, call: str, per: str) -> float:
    """Run `setup`, then `call`, in a fresh process: the resident memory's peak during the call
    above what `setup` left, divided by `per` (bytes). Each big tensor gets a mapping of its own
    (MALLOC_MMAP_THRESHOLD_), so a free shows in the peak at once."""
    code = "\n".join((
        "import torch, moehal",
        "def status(key):",
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key + ':'))",
        setup,
        "open('/proc/self/clear_refs', 'w').write('5')  # VmHWM := VmRSS",
        "before = status('VmRSS')",
        call,
        f"print((status('VmHWM') - before) / ({per}))",
    ))  # fmt: skip
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


_LINUX_PEAK = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak reset")
_LAYER = "E, H, I = 16, 1024, 512"


@_LINUX_PEAK
def test_stacking_experts_allocates_the_layer_once():
    """Engines load every layer so: `torch.stack` of per-expert `torch.cat`s held each expert's
    concatenation beside the result, 1.36x the layer's bytes at the peak here (2.3x with the
    source counted; a load-cost review). One allocation, copied into per expert: about 1x."""
    setup = (
        f"{_LAYER}\ngate, up = ([torch.randn(I, H).bfloat16() for _ in range(E)] for _ in range(2))\n"
        "down = [torch.randn(H, I).bfloat16() for _ in range(E)]"
    )
    ratio = _peak_bytes(setup, "w = moehal.from_per_expert(gate, up, down)", "w.w13.numel() * 2 + w.w2.numel() * 2")
    assert ratio < 1.15, ratio


@_LINUX_PEAK
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_tensor"])
def test_quantizing_a_layer_holds_float32_copies_of_one_expert_only(quant):
    """`quantize_weights` (and the transformers integration's `quant=`, which calls it) made
    several float32 copies of the whole layer: 11x the fp8 result at the peak (a load-cost
    review). Every scheme quantizes per expert, so it runs one expert at a time: about the
    result's bytes plus one expert's temporaries."""
    setup = (
        f"{_LAYER}\ncfg = moehal.MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I)\n"
        "w13, w2 = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()"
    )
    ratio = _peak_bytes(setup, f"q = moehal.quantize_weights(cfg, {quant!r}, w13, w2)", "w13.numel() + w2.numel()")
    assert ratio < 2.0, ratio  # bytes per weight: 1 for the fp8 result
