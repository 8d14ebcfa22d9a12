"""moehal's DeepEP runners (`cuda.deepep`, `cuda.deepep_ll`) end to end on the CPU, against the
single-process oracle, with a test double standing in for the `deep_ep` library
(tests/cuda/deep_ep_double.py): two expert-parallel ranks as threads of one process, several
calls of different sizes.

What this checks is moehal's side:
- the formats each runner hands the experts;
- the normal mode's permute of received tokens into the contiguous layout;
- the weighted and unweighted combines and the routed scaling;
- the bounds and buffer sizes the runners derive.

DeepEP itself runs on no machine here: sgl-deep-ep pins another torch release
(docs/backends/cuda.md)."""

from __future__ import annotations

import sys
import weakref

import deep_ep_double
import pytest
import torch
from deep_ep_double import Group, World, module
from moe_testing import random_topk, random_weights
from moehal.config import MoEConfig
from moehal.formats import ActivationFormat, ContiguousInput, Layout, MaskedInput, ScaleKind
from moehal.hardware import HardwareInfo, detect
from moehal.interfaces import BuildRequest
from moehal.kernels import triton_permute as tp
from moehal.quant import QuantScheme
from moehal.reference.experts import ReferenceExperts
from moehal.reference.oracle import reference_layer
from moehal.routing import TopK
from moehal.weights import local_slice, quantize_weights
from moehal_cuda import deepep
from moehal_cuda.deepep import DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher
from moehal_cuda.deepgemm_experts import MASKED_ROW_ALIGNMENT, DeepGemmExpertsRunner, TorchGemmOps

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the Triton kernels run interpreted
RANKS = 2
# hidden 512: DeepEP's fp8 low-latency dispatch takes hidden sizes that are multiples of 512
SHAPE = dict(num_experts=8, top_k=3, hidden_size=512, intermediate_size=128, routed_scaling_factor=1.5)
# tokens per rank at each call: uneven, a rank with none, the worst case
CALLS = [(5, 7), (8, 0), (3, 6), (8, 8)]


@pytest.fixture(autouse=True)
def _fresh_buffers(monkeypatch):
    """Each test starts and ends without shared DeepEP buffers and permute workspaces (both are
    process-wide: a top-1 test's workspace of another size made a later test's count fail when
    the file ran in another order)."""
    from moehal.kernels import triton_permute

    monkeypatch.setattr(triton_permute, "_WORKSPACE", {})
    deepep.release_buffers()
    yield
    deepep.release_buffers()


def _format(quant: QuantScheme, layout: Layout, alignment: int) -> ActivationFormat:
    if quant.kind.value == "fp8_block":
        ue8m0 = quant.scale_format.value == "ue8m0"
        kind = ScaleKind.GROUP_128_UE8M0 if ue8m0 else ScaleKind.GROUP_128
        return ActivationFormat(layout, torch.float8_e4m3fn, kind, alignment)
    return ActivationFormat(layout, torch.bfloat16, ScaleKind.NONE, alignment)


def _run(
    monkeypatch, quant_name: str, mode: str, experts: str, max_tokens: int, strided: bool = False
) -> list[list[tuple]]:
    """Every call on both ranks; per call and rank: (the experts' input, the rank's output), and
    the oracle's output for all ranks' tokens. `strided`: each rank's inputs as views (rows of
    a wider buffer, column-major top-k), which DeepEP refuses and the dispatchers must copy."""
    monkeypatch.setitem(sys.modules, "deep_ep", module())
    quant = QuantScheme.parse(quant_name)
    gen = torch.Generator().manual_seed(7)
    whole = MoEConfig(**SHAPE, max_tokens=max_tokens * RANKS)
    w13, w2, _, _ = random_weights(whole, gen)
    weights = quantize_weights(whole, quant, w13, w2).to(DEV)
    oracle = reference_layer(whole, quant, DEV)
    oracle.load_weights(weights)
    batches = []
    for sizes in CALLS:
        per_rank = []
        for t in sizes:
            ids, wts = random_topk(t, whole.num_experts, whole.top_k, gen)
            x = torch.randn(t, whole.hidden_size, generator=gen).bfloat16()
            per_rank.append((x.to(DEV), ids.to(DEV), wts.to(DEV)))
        batches.append(per_rank)
    world = World(RANKS)
    ll = mode == "low_latency"

    def rank(r: int) -> list[tuple]:
        cfg = MoEConfig(**SHAPE, max_tokens=max_tokens, ep_rank=r, ep_size=RANKS)
        req = BuildRequest(cfg, quant, detect(DEV), process_group=Group(world, r))
        fmt = _format(quant, Layout.MASKED if ll else Layout.CONTIGUOUS, MASKED_ROW_ALIGNMENT if ll else 8)
        dispatcher = DeepEPLowLatencyDispatcher() if ll else DeepEPNormalDispatcher()
        assert dispatcher.can_produce(fmt, req).ok
        disp = dispatcher.build(req, fmt)
        if experts == "deepgemm":
            ex = DeepGemmExpertsRunner(req, fmt, TorchGemmOps(fmt.is_quantized))
        else:
            ex = ReferenceExperts().build(req, fmt)
        ex.load(local_slice(weights, cfg))
        out = []
        for per_rank in batches:
            x, ids, wts = per_rank[r]
            if strided:
                wide = torch.zeros(x.shape[0], x.shape[1] + 64, dtype=x.dtype, device=x.device)
                wide[:, : x.shape[1]] = x
                x, ids, wts = wide[:, : x.shape[1]], ids.t().contiguous().t(), wts.t().contiguous().t()
            inp, handle = disp.dispatch(x, TopK(ids, wts))
            out.append((inp, disp.combine(ex.apply(inp), handle)))
        return out

    results = world.run(rank)
    checked = []
    for c, per_rank in enumerate(batches):
        x = torch.cat([b[0] for b in per_rank])
        ids = torch.cat([b[1] for b in per_rank])
        wts = torch.cat([b[2] for b in per_rank])
        want = oracle(x, ids, wts).float()
        got = torch.cat([results[r][c][1].float() for r in range(RANKS)])
        assert got.shape == want.shape, f"call {c}"
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-3)).item()
        tol = 4e-2 if quant.kind.value == "fp8_block" else 2e-2
        assert err < tol, f"call {c} {CALLS[c]}: rel err {err:.4f}"
        checked.append([results[r][c] for r in range(RANKS)])
    return checked


@pytest.mark.parametrize(
    "quant_name,experts",
    [("bf16", "reference"), ("fp8_block", "reference"), ("fp8_block:ue8m0", "reference"), ("bf16", "deepgemm")],
)
def test_low_latency_runner_matches_the_oracle(monkeypatch, quant_name, experts):
    """`cuda.deepep_ll`: masked `[E_local, ranks * max_tokens, H]` input (fp8 with power-of-two
    scales for experts that want UE8M0), the experts' rows combined by DeepEP's weighted sum,
    routed scaling after. The input carries a bound on its rows far below the buffer's."""
    max_tokens = 64  # ranks * max_tokens = 128 rows per expert: DeepGEMM's masked alignment
    for call in _run(monkeypatch, quant_name, "low_latency", experts, max_tokens):
        for inp, _ in call:
            assert isinstance(inp, MaskedInput) and inp.hidden.shape[:2] == (4, RANKS * max_tokens)
            bound = RANKS * max_tokens * SHAPE["top_k"]  # min(top_k, 4 local experts) rows per token
            assert inp.total_rows_bound == bound < inp.hidden.shape[0] * inp.hidden.shape[1]
            assert int(inp.masked_m.sum()) <= bound
            if quant_name == "fp8_block:ue8m0":  # round_scale: power-of-two scales
                s = inp.scales[inp.scales > 0]
                assert torch.equal(s, torch.exp2(torch.log2(s).round()))


@pytest.mark.parametrize("quant_name,experts", [("bf16", "reference"), ("fp8_block", "deepgemm"), ("bf16", "deepgemm")])
def test_normal_runner_matches_the_oracle_and_keeps_one_buffer(monkeypatch, quant_name, experts):
    """`cuda.deepep`: received tokens permuted into the contiguous layout (quantized after the
    all-to-all for fp8 experts), combined with the router weights per rank, then summed over
    ranks by DeepEP. Each call receives another number of tokens; its rows come from one
    buffer sized for the worst case, not from a new persistent buffer per count."""
    max_tokens = 8
    for call in _run(monkeypatch, quant_name, "normal", experts, max_tokens):
        for inp, _ in call:
            assert isinstance(inp, ContiguousInput)
    # every rank's max_tokens, each token with at most min(top_k, local experts) rows here (the
    # tests of this file all use max_tokens 8, so this role never holds another size)
    cap = tp.contiguous_rows(max_tokens * RANKS * SHAPE["top_k"], 4, 8)
    rows = {k[1] for k in tp._WORKSPACE if k[0] == "deepep.contiguous"}
    assert rows == {(cap,)}, f"buffers per received count: {sorted(rows)}"
    if experts == "deepgemm":  # the experts' buffers too: sized for the EP worst case, not per call
        tag = f"{2 * SHAPE['intermediate_size']}:{SHAPE['intermediate_size']}:{SHAPE['hidden_size']}"
        rows = {k[1] for k in tp._WORKSPACE if k[0].startswith("dg.") and tag in k[0] and len(k[1]) == 1}
        assert rows == {(cap,)}, f"experts' buffers: {sorted(rows)}"


@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_dispatchers_hand_deep_ep_dense_inputs(monkeypatch, mode):
    """DeepEP asserts that x, topk_idx and topk_weights are contiguous (its `Buffer` checks, as
    the double does): an engine's views of wider rows and column-major top-k still run."""
    assert _run(monkeypatch, "bf16", mode, "reference", 64 if mode == "low_latency" else 8, strided=True)


def test_contiguous_buffers_past_their_capacity_come_in_powers_of_two():
    """A call past the static capacity (an EP rank without max_tokens, or an unusual batch)
    gets a buffer of the next power of two of its rows, shared with other sizes in that range:
    a stream of distinct sizes keeps a few buffers, not one each."""
    role = "test.growth"
    sizes = [136, 200, 256, 264, 300, 500, 520, 1000]
    views = [tp.contiguous_workspace(role, m, 128, 64, torch.bfloat16, "cpu", False) for m in sizes]
    assert [v.hidden.shape[0] for v in views] == sizes
    kept = sorted(k[1][0] for k in tp._WORKSPACE if k[0] == role)
    assert kept == [256, 512, 1024]


def test_layers_share_one_deep_ep_buffer_per_group_and_mode(monkeypatch):
    """One `deep_ep.Buffer` per (process group, mode) for every layer of a process, as SGLang
    and DeepEP's README keep it: a second low-latency buffer fails DeepEP's NVSHMEM set-up
    (the double asserts it), and one per layer would take gigabytes each. A layer that needs
    more replaces the buffer for all; one with another local expert count is declined."""
    monkeypatch.setitem(sys.modules, "deep_ep", module())
    world = World(RANKS)
    group = Group(world, 0)
    quant = QuantScheme.parse("bf16")
    fmt = _format(quant, Layout.MASKED, MASKED_ROW_ALIGNMENT)

    def build(dispatcher, max_tokens, **kw):
        cfg = MoEConfig(**{**SHAPE, **kw}, max_tokens=max_tokens, ep_rank=0, ep_size=RANKS)
        req = BuildRequest(cfg, quant, detect(DEV), process_group=group)
        if kw:  # the checks only (hidden 512 is the tests' small shape, not a DeepEP one)
            return dispatcher.check_limits(req)
        return dispatcher.build(req, fmt)

    made = len(deep_ep_double.Buffer.made)
    a, b = build(DeepEPLowLatencyDispatcher(), 64), build(DeepEPLowLatencyDispatcher(), 64)
    assert a.shared is b.shared and len(deep_ep_double.Buffer.made) == made + 1
    first = weakref.ref(a.shared.buffer)
    big = build(DeepEPLowLatencyDispatcher(), 128)  # twice the rows: a larger buffer, for every layer
    assert big.shared is a.shared and first() is None  # the old one freed before the new one was made
    assert len(deep_ep_double.Buffer.made) == made + 2
    assert a.shared.buffer.num_rdma_bytes == 128 * SHAPE["hidden_size"] * RANKS
    assert build(DeepEPLowLatencyDispatcher(), 64).shared.buffer is big.shared.buffer  # no shrink, no new one
    # normal mode keeps its own buffer on the same group
    normal = build(DeepEPNormalDispatcher(), 8)
    assert normal.shared is not a.shared and not normal.shared.buffer.low_latency_mode
    # 16 experts over 2 ranks: 8 local experts, 8 QPs, where the process's buffer has 4
    assert build(DeepEPLowLatencyDispatcher(), 64, hidden_size=2048).ok
    d = build(DeepEPLowLatencyDispatcher(), 64, num_experts=16, hidden_size=2048)
    assert not d.ok and "4 local experts" in d.reason and "has 8" in d.reason
    assert deepep.release_buffers() == 2


def test_a_buffer_that_fails_to_grow_leaves_what_a_retry_needs(monkeypatch):
    """`deep_ep.Buffer` raising while the shared buffer grows (out of memory, NVSHMEM failing to
    make its QPs): the sizes and QP count were recorded before it, so a retry with smaller sizes
    asked for the failed ones again, a failed first low-latency build left its QP count for the
    next, and the layers built before read a buffer of None. Now the failed sizes are not kept,
    the retry builds, and a layer whose buffer was freed says why."""
    limit = 1000

    class Tight(deep_ep_double.Buffer):
        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, **kw):
            if kw.get("num_qps_per_rank") == 8:
                raise RuntimeError("NVSHMEM: failed to create QPs")
            if num_rdma_bytes > limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory (asked {num_rdma_bytes} B)")
            super().__init__(group, num_nvl_bytes, num_rdma_bytes, **kw)

    mod = module()
    mod.Buffer = Tight
    monkeypatch.setitem(sys.modules, "deep_ep", mod)
    group = Group(World(RANKS), 0)
    a = deepep.shared_buffer(group, False, 0, 500)
    with pytest.raises(torch.OutOfMemoryError):
        deepep.shared_buffer(group, False, 0, 5000)
    with pytest.raises(RuntimeError, match="freed to make a larger one"):
        a.live  # noqa: B018 (the property raises)
    retry = deepep.shared_buffer(group, False, 0, 800)  # every rank builds again, smaller
    assert retry is a and a.live.num_rdma_bytes == 800 and a.num_rdma_bytes == 800
    with pytest.raises(RuntimeError, match="QPs"):
        deepep.shared_buffer(group, True, 0, 500, qps=8)
    ll = deepep.shared_buffer(group, True, 0, 500, qps=4)
    assert ll.num_qps_per_rank == 4 == ll.live.num_qps_per_rank
    assert deepep.shared_buffer(group, True, 0, 500, qps=4) is ll


@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_router_weight_on_input_is_applied_once(monkeypatch, mode):
    """`apply_router_weight_on_input` (top-1): the dispatcher scales the tokens before sending
    them and combines with unit weights, so the router weight counts once, as in the oracle."""
    monkeypatch.setitem(SHAPE, "top_k", 1)
    monkeypatch.setitem(SHAPE, "apply_router_weight_on_input", True)
    assert _run(monkeypatch, "bf16", mode, "reference", 64 if mode == "low_latency" else 8)


def test_low_latency_max_tokens_is_bounded_by_the_qp_depth(monkeypatch):
    """DeepEP's low-latency mode needs NVSHMEM_QP_DEPTH >= 2 * (max_tokens + 1): at the default
    depth 1024, max_tokens 511 is the largest accepted and 512 is declined at build, with why."""
    hw = HardwareInfo("cuda", torch.device("cuda", 0), "Test H100", (9, 0))

    def check(max_tokens):
        cfg = MoEConfig(
            num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, ep_size=8, max_tokens=max_tokens
        )
        return DeepEPLowLatencyDispatcher.check_limits(BuildRequest(cfg, QuantScheme.parse("bf16"), hw))

    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    assert check(511).ok
    d = check(512)
    assert not d.ok and "NVSHMEM_QP_DEPTH >= 1026" in d.reason and "now 1024" in d.reason
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "1026")
    assert check(512).ok
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "1k")  # declined, naming it (it raised out of the check)
    d = check(64)
    assert not d.ok and "NVSHMEM_QP_DEPTH='1k' is not an integer" in d.reason
