"""Expert parallelism across processes: gloo on the CPU, world sizes 2 and 4 (and the suite alone on 3).

Each world size spawns its ranks once and runs the whole `moehal.distributed_check` suite
(bf16, fp8 group-128, int8 per-token; contiguous, masked, standard; uneven loads, empty
ranks, empty experts, top-k spanning ranks); every rank's output is compared with the
single-process reference layer on the same tokens. The same spawn checks the rows put on
the wire and that a deliberately broken EP dispatcher fails the suite.
"""

from __future__ import annotations

import time

import ep_test_workers as workers
import pytest
from moehal import distributed_check as dc

pytestmark = pytest.mark.timeout(240)

CASES = dc.ep_cases(4)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def spawned(request):
    world = request.param
    outcomes = dc.run_spawned(world, workers.suite_worker, timeout_s=180, op_timeout_s=90)
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank} {o.status}: {o.error}" for o in bad)
    assert len(outcomes) == world
    return world, [o.result for o in outcomes]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.name for c in CASES])
def test_case_matches_reference(spawned, i):
    _, per_rank = spawned
    rows = dc.summarize([r["suite"] for r in per_rank])
    assert len(rows) == len(CASES)
    row = rows[i]
    assert row.case == CASES[i].name
    assert row.verdict == "PASS", row.detail
    assert row.pipeline.startswith("reference.torch_distributed -> reference.experts"), row.pipeline


def test_contiguous_alignment(spawned):
    """Experts that want aligned segments (row_alignment 8) get them through the EP dispatcher."""
    _, per_rank = spawned
    rows = dc.summarize([r["aligned"] for r in per_rank])
    assert len(rows) == len(workers.ALIGNED_CASES)
    for row in rows:
        assert row.verdict == "PASS", row.detail
        assert "aligned.experts_aligned8" in row.pipeline and "align 8" in row.pipeline, row.pipeline


def test_ranks_poison_their_allocations(spawned):
    """Experts reading a buffer they never cleared fail on every rank when the ranks poison
    (`run_ep_cases(poison=True)`, what `moehal conformance --ep` runs)."""
    _, per_rank = spawned
    rows = dc.summarize([r["uncleared"] for r in per_rank])
    assert len(rows) == 1 and rows[0].verdict != "PASS", rows
    assert "uncleared.experts_uncleared" in rows[0].pipeline, rows[0].pipeline
    assert all(not r["uncleared"][0].ok for r in per_rank)


def test_ranks_agree_on_the_verdict(spawned):
    _, per_rank = spawned
    for per_case in zip(*[r["suite"] for r in per_rank]):
        assert len({r.all_ok for r in per_case}) == 1


def test_each_token_is_sent_once_per_destination_rank(spawned):
    world, per_rank = spawned
    for r in per_rank:
        w = r["wire"]
        assert w["send"] == w["expected_send"]
        assert w["recv"] == w["expected_recv"]
    case = workers.WIRE_CASE
    total = sum(r["wire"]["slots"] for r in per_rank)
    assert total <= sum(case.tokens(world)) * min(case.top_k, world)  # not k copies per token


def test_masked_rows_without_max_tokens_come_in_powers_of_two(spawned):
    """Without max_tokens, the masked buffer's rows per expert follow the rows this rank
    received, rounded up to a power of two: a serving loop meets a few buffer shapes, so
    experts that keep workspaces per shape keep a few, not one per call."""
    _, per_rank = spawned
    for r in per_rank:
        rows, received = r["wire"]["masked_rows"], r["wire"]["masked_received"]
        assert rows == (1 << (received - 1).bit_length() if received else 0), (rows, received)


def test_a_broken_dispatcher_is_caught(spawned):
    """The suite has teeth: an EP dispatcher that mixes up router weights must fail."""
    _, per_rank = spawned
    results = [r["broken"] for r in per_rank]
    assert all(r[0].pipeline.startswith("broken.broken_ep") for r in results)
    assert all(not r[0].all_ok for r in results)
    assert dc.summarize(results)[0].verdict == "FAIL"


def test_a_failing_rank_errors_every_rank_quickly():
    case = dc.with_fault(dc.EPCase("fault"), rank=1)
    t0 = time.monotonic()
    outcomes = dc.run_spawned(2, dc.run_ep_cases, ([case],), timeout_s=60, op_timeout_s=20)
    elapsed = time.monotonic() - t0
    assert [o.status for o in outcomes] == ["error", "error"], [(o.status, o.error[-400:]) for o in outcomes]
    assert "InjectedFault" in outcomes[1].error
    assert "InjectedFault" not in outcomes[0].error  # rank 0 failed in its own collective
    assert elapsed < 45, f"took {elapsed:.1f}s"


def test_the_suite_sizes_its_experts_for_a_world_of_three():
    # 3 ranks do not divide 8 experts: the suite takes 24 there rather than failing every case
    assert {c.num_experts for c in dc.ep_cases(3)} == {24} and {c.num_experts for c in dc.ep_cases(4)} == {8}
    outcomes = dc.run_spawned(3, workers.suite_only_worker, timeout_s=180, op_timeout_s=90)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.error for o in outcomes]
    rows = dc.summarize([o.result for o in outcomes])
    assert len(rows) == len(CASES) and all(r.verdict == "PASS" for r in rows), [(r.case, r.detail) for r in rows]


def test_combine_applies_routed_scaling_once(world_of_one):
    """Experts that scale their STANDARD output in their last kernel (`scaled=True`) must not
    get routed_scaling_factor again in combine; unscaled output gets it once. One process, a
    gloo group of one: the all-to-all hands every row back to this rank."""
    import moehal
    import torch
    from moehal.ep_dispatcher import TorchDistributedDispatcher
    from moehal.formats import ActivationFormat, Layout, StandardInput, StandardOutput
    from moehal.interfaces import BuildRequest

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, routed_scaling_factor=2.5)
    req = BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), moehal.detect("cpu"), process_group=world_of_one)
    runner = TorchDistributedDispatcher().build(req, ActivationFormat(Layout.STANDARD, torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 1], [0, 3]], dtype=torch.int32)
    inp, handle = runner.dispatch(x, moehal.TopK(ids, torch.rand(5, 2, generator=gen)))
    assert isinstance(inp, StandardInput) and inp.hidden.shape == (5, 16)  # one row per token
    y = torch.randn(5, 16, generator=gen).bfloat16()  # stands in for the experts' weighted sums
    assert torch.equal(runner.combine(StandardOutput(y, scaled=True), handle), y)
    torch.testing.assert_close(runner.combine(StandardOutput(y), handle), (y.float() * 2.5).bfloat16())


def test_ids_past_the_experts_are_dropped_not_indexed(world_of_one):
    """Unchecked input (validate=False, the GPU default) may hold ids >= num_experts. No rank
    owns such a slot: it is not sent, and combine must read it as the zero row. Before, only the
    first such slot landed on the zero row and a second indexed past the received rows
    (IndexError here; a device-side assert under NCCL)."""
    import moehal
    import torch
    from moehal.ep_dispatcher import TorchDistributedDispatcher
    from moehal.formats import ActivationFormat, Layout, StandardOutput
    from moehal.interfaces import BuildRequest

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)
    req = BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), moehal.detect("cpu"), process_group=world_of_one)
    runner = TorchDistributedDispatcher().build(req, ActivationFormat(Layout.STANDARD, torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen).bfloat16()
    ids = torch.tensor([[0, 5], [1, 2], [7, 0], [2, 4]], dtype=torch.int32)
    inp, handle = runner.dispatch(x, moehal.TopK(ids, torch.ones(4, 2)))
    assert inp.hidden.shape == (4, 16)  # every token still has one good slot
    got = runner.combine(StandardOutput(inp.hidden, scaled=True), handle)
    assert torch.equal(got, x)  # the received rows come back; the bad slots add nothing
