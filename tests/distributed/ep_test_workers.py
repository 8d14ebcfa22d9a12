"""Spawned-rank workers for the EP tests (module-level so torch.multiprocessing can pickle them),
and a deliberately broken EP dispatcher plugin that the suite must catch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from moehal.capability import accept
from moehal.distributed_check import EPCase, make_inputs
from moehal.ep_dispatcher import TorchDistributedDispatcher, TorchDistributedDispatchRunner
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, BuildRequest, Dispatcher
from moehal.layer import MoELayer
from moehal.quant import QuantScheme
from moehal.weights import local_slice, quantize_weights


# --- a broken EP dispatcher: rolls the router weights of received tokens by one slot ----------
class _BrokenRunner(TorchDistributedDispatchRunner):
    def dispatch(self, hidden, topk):
        out, handle = super().dispatch(hidden, topk)
        return out, dataclasses.replace(handle, recv_weights=handle.recv_weights.roll(1, dims=1))


class BrokenDispatcher(TorchDistributedDispatcher):
    name = "broken_ep"
    priority = 6

    def build(self, req: BuildRequest, fmt):
        return _BrokenRunner(req, fmt)


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name="broken", version="0", description="test-only broken EP dispatcher", available=lambda hw: accept("test")
    )


@hookimpl
def moehal_dispatchers() -> Sequence[Dispatcher]:
    return [BrokenDispatcher()]


# --- wire accounting: what the dispatcher sends, against an independent count -----------------
def count_rows(rank: int, world: int, case: EPCase) -> dict:
    """Dispatch one batch and return (rows sent per peer, rows received per peer, expected)."""
    inp = make_inputs(case, world)
    cfg = case.config(rank, world)
    full = quantize_weights(case.config(), QuantScheme.parse(case.quant), inp.w13, inp.w2)
    import torch.distributed as dist

    layer = MoELayer(
        cfg, case.quant, backend="reference", device="cpu", layout=case.layout, process_group=dist.group.WORLD
    )
    layer.load_weights(local_slice(full, cfg))
    lo, n = inp.offsets[rank], case.tokens(world)[rank]
    ids = inp.ids[lo : lo + n]
    from moehal.routing import TopK

    topk = TopK(ids, inp.weights[lo : lo + n])
    _, handle = layer._dispatch.dispatch(inp.x[lo : lo + n], topk)
    # the same batch into the masked layout, without max_tokens: rows per expert from the call
    assert cfg.max_tokens is None
    group = dist.group.WORLD
    masked = MoELayer(cfg, case.quant, backend="reference", device="cpu", layout="masked", process_group=group)
    masked.load_weights(local_slice(full, cfg))
    masked_inp, masked_handle = masked._dispatch.dispatch(inp.x[lo : lo + n], topk)
    owner = ids // cfg.num_local_experts
    expected_send = [int((owner == r).any(dim=1).sum()) for r in range(world)]  # distinct (token, rank)
    all_owner = inp.ids // cfg.num_local_experts
    expected_recv = []
    for src in range(world):
        s_lo, s_n = inp.offsets[src], case.tokens(world)[src]
        expected_recv.append(int((all_owner[s_lo : s_lo + s_n] == rank).any(dim=1).sum()))
    return {
        "send": handle.send_splits,
        "recv": handle.recv_splits,
        "expected_send": expected_send,
        "expected_recv": expected_recv,
        "slots": int(torch.tensor(expected_send).sum()),
        "masked_rows": masked_inp.hidden.shape[1],
        "masked_received": sum(masked_handle.recv_splits),
    }


WIRE_CASE = EPCase("wire", top_k=4, num_experts=8, tokens_per_rank=(7, 3, 0, 5), routing="random", seed=11)
BROKEN_CASE = EPCase("broken weights", top_k=3, tokens_per_rank=(8, 5))
UNCLEARED_CASE = EPCase("uncleared experts' buffer", layout="standard", tokens_per_rank=(6, 4))
ALIGNED_CASES = [
    EPCase("contiguous aligned to 8, bf16", top_k=3, tokens_per_rank=(9, 0, 4, 6)),
    EPCase("contiguous aligned to 8, fp8", quant="fp8_block", routing="skewed", tokens_per_rank=(5, 12)),
]


def suite_only_worker(rank: int, world: int) -> list:
    """The standard EP suite alone, on `world` ranks."""
    from moehal import distributed_check as dc

    return dc.run_ep_cases(rank, world)


def suite_worker(rank: int, world: int) -> dict:
    """Everything one spawn of `world` ranks checks (spawning costs more than the cases)."""
    from moehal import distributed_check as dc

    return {
        "suite": dc.run_ep_cases(rank, world),
        "wire": count_rows(rank, world, WIRE_CASE),
        "aligned": dc.run_ep_cases(
            rank, world, ALIGNED_CASES, backend="aligned", plugins=[("aligned", "ep_aligned_plugin")]
        ),
        "broken": dc.run_ep_cases(
            rank, world, [BROKEN_CASE], dispatcher="broken.broken_ep", plugins=[("broken", "ep_test_workers")]
        ),
        "uncleared": dc.run_ep_cases(
            rank,
            world,
            [UNCLEARED_CASE],
            backend="uncleared",
            plugins=[("uncleared", "ep_uncleared_plugin")],
            poison=True,
        ),
    }
