"""Ranks of one expert-parallel layer must agree on what crosses the wire (session 44's EP
audit): a layer built from disagreeing configs raises `ConfigError` on every rank at build,
and a small-batch format that would send other rows than the main one is not selected under EP.
Before, gloo aborted the process ("Received data size doesn't match expected size") or the
ranks computed silently wrong rows."""

from __future__ import annotations

import pytest
import torch
from moehal import distributed_check as dc

pytestmark = pytest.mark.timeout(240)

FULL = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
# rank 1's change to the layer each case builds; rank 0 builds FULL in bf16
DISAGREE = {
    "top_k": (dict(top_k=3), "bf16"),
    "activation": (dict(activation="gelu"), "bf16"),  # silently wrong before: rows ran another activation
    "num_experts": (dict(num_experts=16), "bf16"),  # silently wrong before: other expert slices
    "quant": ({}, "fp8_block"),  # aborted the process before
}


def _layer(rank: int, world: int, change: dict, quant: str, **kw):
    import torch.distributed as dist
    from moehal import MoEConfig, MoELayer

    cfg = MoEConfig(**{**FULL, **change}, ep_rank=rank, ep_size=world)
    backend = kw.pop("backend", "reference")
    return MoELayer(cfg, quant, backend=backend, device="cpu", process_group=dist.group.WORLD, **kw)


def _run(layer, quant: str, tokens: list[int], rank: int, registry=None) -> float:
    """This rank's rows against the single-process reference on every rank's tokens: max error."""
    from moehal import MoEConfig, quantize_weights
    from moehal.reference.oracle import reference_layer
    from moehal.weights import local_slice

    full_cfg = MoEConfig(**FULL)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(8, 128, 128, generator=g) / 11.3
    w2 = torch.randn(8, 128, 64, generator=g) / 8
    full = quantize_weights(full_cfg, quant, w13, w2)
    layer.load_weights(local_slice(full, layer.config))
    xs = [torch.randn(t, 128, generator=g).to(torch.bfloat16) for t in tokens]
    ids = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]) for t in tokens]
    ws = [torch.rand(t, 2, generator=g) + 0.1 for t in tokens]
    y = layer(xs[rank], ids[rank], ws[rank]).float()
    ref = reference_layer(full_cfg, quant, "cpu", registry=registry)
    ref.load_weights(full)
    lo = sum(tokens[:rank])
    r = ref(torch.cat(xs), torch.cat(ids), torch.cat(ws)).float()[lo : lo + tokens[rank]]
    return float((y - r).abs().max() / r.abs().max())


def agreement_worker(rank: int, world: int) -> dict:
    from moehal import ConfigError

    out: dict = {}
    for name, (change, quant) in DISAGREE.items():
        try:
            _layer(rank, world, change if rank == 1 else {}, quant if rank == 1 else "bf16")
            out[name] = "built"
        except ConfigError as exc:
            out[name] = str(exc)
    # legitimately per rank: each rank's own bound on its tokens
    layer = _layer(rank, world, {"max_tokens": 8 if rank == 0 else 16}, "bf16")
    out["max_tokens"] = _run(layer, "bf16", [3, 12], rank)
    reg = dc.default_registry([("smallfmt", "ep_small_plugin")])
    for quant in ("fp8_block", "bf16"):
        layer = _layer(rank, world, {}, quant, backend="smallfmt", registry=reg)
        small = layer.plan.pipeline.small
        declines = [d.reason for d in layer.plan.decisions if "small-batch format" in d.reason]
        # rank 0 under the small-batch bound (4 tokens), rank 1 over it
        out[f"small {quant}"] = (str(small.fmt) if small else None, declines, _run(layer, quant, [2, 10], rank, reg))
    return out


@pytest.fixture(scope="module")
def outcomes():
    results = dc.run_spawned(2, agreement_worker, timeout_s=180, op_timeout_s=60)
    bad = [o for o in results if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank} {o.status}: {o.error}" for o in bad)
    return [o.result for o in results]


@pytest.mark.parametrize("name", list(DISAGREE))
def test_disagreeing_ranks_raise_config_error_on_every_rank(outcomes, name):
    for rank, out in enumerate(outcomes):
        msg = out[name]
        assert msg != "built", f"rank {rank} built a layer its peer disagrees with ({name})"
        assert "ranks of this expert-parallel layer disagree" in msg
        field = "quant" if name == "quant" else name
        assert f"{field}=" in msg, msg


def test_max_tokens_may_differ_between_ranks(outcomes):
    assert all(out["max_tokens"] < 1e-2 for out in outcomes)


def test_a_small_format_sending_other_rows_is_not_selected_under_ep(outcomes):
    for out in outcomes:
        small, declines, err = out["small fp8_block"]
        assert small is None
        assert any("would not send the rows" in d for d in declines), declines
        assert err < 0.05, "rank 0 (2 tokens) and rank 1 (10 tokens) both dispatch fp8 rows"


def test_a_small_format_sending_the_same_rows_is_kept_under_ep(outcomes):
    for out in outcomes:
        small, declines, err = out["small bf16"]
        assert small is not None and small.startswith("standard"), small
        assert not declines
        assert err < 1e-2
