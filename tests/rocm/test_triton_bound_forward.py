"""The portable fused MoE bound once per token count (`bind_fused_moe`): a bound forward called
again with new tensors gives what `fused_moe` gives, and the experts runner keeps one per token
count until its weights or the tuned tables change. Interpreted on CPU (CI), compiled on a GPU."""

from __future__ import annotations

import moehal
import pytest
import torch
from _rocm_testing import DEVICE, TOL, needs_triton, problem, rel_err, triton_registry
from moehal.reference.oracle import reference_layer

pytestmark = needs_triton


def _weights(e: int = 4, h: int = 64, i: int = 64, quant: str = "none"):
    from moehal.kernels import triton_fused_moe as k

    g = torch.Generator().manual_seed(1)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16().to(DEVICE)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16().to(DEVICE)
    return k.TritonMoEWeights(w13, w2)


def _batch(t: int, h: int, e: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16().to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).int().to(DEVICE)
    return x, ids, (torch.rand(t, top_k, generator=g) + 0.1).to(DEVICE)


def test_a_bound_forward_called_again_gives_what_fused_moe_gives():
    from moehal.kernels import triton_fused_moe as k

    w = _weights()
    bound = k.bind_fused_moe(5, 2, w)
    for seed in (0, 1):  # new tensors at every call: nothing of the first call is kept
        x, ids, wts = _batch(5, 64, 4, 2, seed)
        got = bound(x, ids, wts)
        assert torch.equal(got, k.fused_moe(x, ids, wts, w))
        out = torch.empty_like(x)
        assert bound(x, ids, wts, out=out) is out and torch.equal(out, got)
    sorted_ids, expert_ids, num_post = bound.align(ids.reshape(-1))
    # three views of one allocation, each on a 16-byte boundary (Triton's aligned-pointer case)
    assert all(v.data_ptr() % 16 == 0 for v in (sorted_ids, expert_ids, num_post))
    want = k.moe_align_block_size_torch(ids, bound.configs[0].block_m, 4)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip((sorted_ids, expert_ids, num_post), want, strict=True))


def test_a_bound_forward_refuses_other_batches():
    from moehal.kernels import triton_fused_moe as k

    bound = k.bind_fused_moe(5, 2, _weights())
    x, ids, wts = _batch(6, 64, 4, 2, 0)
    with pytest.raises(ValueError, match="bound for \\[5, 64\\]"):
        bound(x, ids, wts)
    x, ids, wts = _batch(5, 64, 4, 2, 0)
    with pytest.raises(ValueError, match="bound for"):
        bound(x.float(), ids, wts)  # another dtype would take other precision: refused, not guessed
    with pytest.raises(ValueError, match="out must be"):
        bound(x, ids, wts, out=torch.empty(5, 64, device=DEVICE))


def _layer(cfg: moehal.MoEConfig, quant: str):
    reg = triton_registry()
    ours = moehal.MoELayer(cfg, quant, backend="tritonmoe", device=DEVICE, registry=reg)
    return ours, reference_layer(cfg, quant, DEVICE, registry=reg)


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "w8a8_int8"])
def test_the_runner_keeps_one_binding_per_token_count(quant, monkeypatch):
    from moehal.kernels import triton_experts
    from moehal.kernels import triton_fused_moe as k

    monkeypatch.setattr(triton_experts, "KEEP_BOUND_TOKENS", 4)
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    ours, ref = _layer(cfg, quant)
    w, _, _, _ = problem(cfg, quant, 1)
    ours.load_weights(w)
    ref.load_weights(w)
    runner = ours._experts
    for t, seed in ((3, 0), (6, 1), (3, 2), (6, 3)):  # counts taking turns, new inputs each time
        _, x, ids, wts = problem(cfg, quant, t, seed)
        assert rel_err(ours(x, ids, wts), ref(x, ids, wts)) < TOL[quant]
    assert sorted(runner._bound) == [3], "3 tokens kept; 6 (> KEEP_BOUND_TOKENS) bound at every call"
    kept = runner._bound[3]
    _, x, ids, wts = problem(cfg, quant, 3, 4)
    ours(x, ids, wts)
    assert runner._bound[3] is kept
    k.register_tuned_configs("Some other GPU", {})  # tiles may have changed: bound again
    ours(x, ids, wts)
    assert runner._bound[3] is not kept
    runner.load(runner.w)  # weights loaded (again): the launches holding the old ones are dropped
    assert runner._bound == {}
    assert rel_err(ours(x, ids, wts), ref(x, ids, wts)) < TOL[quant]
    assert runner._bound[3] is not kept


def test_a_slot_whose_id_is_past_the_experts_adds_nothing():
    """Unchecked ids (validate=False, the GPU default) may reach the fused MoE outside [0, E).
    The align pass drops such a slot from both GEMMs, so its intermediate row is never written;
    the top-k sum must skip it as it skips -1. Before, it added that row of `torch.empty`."""
    from moehal.kernels import triton_fused_moe as k

    w = _weights()
    x, ids, wts = _batch(5, 64, 4, 2, 0)
    bad = ids.clone()
    bad[0, 1] = 4  # == E
    bad[2, 0] = 9
    drop = bad.clone()
    drop[0, 1] = drop[2, 0] = -1  # what the slots should amount to: nothing
    want = k.fused_moe(x, drop, wts, w)
    for _ in range(2):  # the uninitialized rows differ from call to call
        assert torch.equal(k.fused_moe(x, bad, wts, w), want)
