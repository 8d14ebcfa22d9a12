"""Expert-parallel correctness cases any EP dispatcher can be run through.

Each case is run on every rank of an initialized process group (`run_ep_case`): all ranks
build the same global inputs from the case's seed, rank r keeps its own tokens and loads
only its local experts (`moehal.weights.local_slice`), runs the EP layer, and compares its
rows with the single-process reference layer (`ep_size=1`, backend `reference`) on all
tokens. The verdict is agreed on all ranks (one `all_reduce`), so every rank reports the
same pass/fail.

Used by tests/distributed (gloo on CPU, world sizes 2 and 4), tools/ep_gpu_check.py (NCCL on
GPUs, under torchrun) and the conformance suite (`dispatcher=` forces one dispatcher, e.g. a
vendor's DeepEP or HCCL dispatcher). `run_spawned` starts a local group of processes with
bounded timeouts: a failure in one rank surfaces as an error on every rank, never a hang.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib
import math
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from moehal.config import MoEConfig
from moehal.errors import NoBackendError
from moehal.layer import MoELayer
from moehal.plugins import Registry, discover
from moehal.quant import QuantScheme
from moehal.settings import Settings
from moehal.weights import local_slice, quantize_weights


class InjectedFault(RuntimeError):
    """Raised on purpose by a case with `fail_rank` set (tests the no-hang property)."""


@dataclass(frozen=True)
class EPCase:
    """One expert-parallel scenario; sizes are per layer, tokens per rank.

    tokens_per_rank: tokens of rank r are `tokens_per_rank[r % len]`.
    routing: how global top-k ids are drawn:
        random: distinct uniform experts per token;
        skewed: most slots go to rank 0's experts (uneven loads);
        avoid_last_rank: no slot targets the last rank (it receives nothing);
        even_experts: only even expert ids (odd experts get no tokens);
        span_ranks: a token's k slots sit on k different ranks (as far as ranks go);
        same_rank: all k slots of a token sit on one rank.
    fail_rank: this rank raises `InjectedFault` right before the forward.
    padded: some ids are -1 (`MoEConfig.topk_padding`): every third token's slots and one slot of
        every fourth token.
    """

    name: str
    quant: str = "bf16"
    layout: str | None = "contiguous"
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 256
    intermediate_size: int = 128
    tokens_per_rank: tuple[int, ...] = (6, 9, 4, 11)
    routing: str = "random"
    dtype: torch.dtype = torch.bfloat16
    max_tokens: int | None = None
    routed_scaling_factor: float = 1.0
    apply_router_weight_on_input: bool = False
    seed: int = 0
    fail_rank: int | None = None
    padded: bool = False

    def config(self, ep_rank: int = 0, ep_size: int = 1) -> MoEConfig:
        return MoEConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            routed_scaling_factor=self.routed_scaling_factor,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            ep_rank=ep_rank,
            ep_size=ep_size,
            dtype=self.dtype,
            max_tokens=self.max_tokens,
            topk_padding=self.padded,
        )

    def tokens(self, world: int) -> list[int]:
        return [self.tokens_per_rank[r % len(self.tokens_per_rank)] for r in range(world)]


def ep_cases(world: int) -> list[EPCase]:
    """The standard EP suite for `world` ranks: 8 experts, or the least multiple of 8 that
    `world` divides (24 for 3 ranks), so every world size gets whole ranks of experts."""
    experts = 8 * world // math.gcd(8, world)
    return [dataclasses.replace(c, num_experts=experts) for c in _EP_CASES]


_EP_CASES = [
    EPCase("bf16 contiguous, random routing"),
    EPCase("bf16 masked, max_m from received rows", layout="masked"),
    EPCase("bf16 masked, static max_m = max_tokens*ep", layout="masked", max_tokens=16),
    EPCase("bf16 standard", layout="standard"),
    EPCase("uneven loads, a rank with no tokens", tokens_per_rank=(13, 0, 5, 1), routing="skewed"),
    EPCase("a rank that receives nothing", routing="avoid_last_rank", layout="masked", tokens_per_rank=(7, 4)),
    EPCase("experts with no tokens", routing="even_experts", tokens_per_rank=(3, 5, 2)),
    EPCase("top-k spanning ranks, scaling 2.5", top_k=4, routing="span_ranks", routed_scaling_factor=2.5),
    EPCase("top-k on one rank (dedup)", routing="same_rank", layout="masked", top_k=2),
    EPCase("no tokens on any rank", tokens_per_rank=(0,)),
    EPCase("fp8_block group-128 contiguous", quant="fp8_block", top_k=3),
    EPCase("fp8_block group-128 masked, uneven", quant="fp8_block", layout="masked", tokens_per_rank=(9, 0, 2)),
    EPCase("w8a8_int8 per-token standard", quant="w8a8_int8", layout="standard", routing="skewed"),
    EPCase("w8a8_int8 per-token contiguous", quant="w8a8_int8", top_k=4, routing="span_ranks"),
    EPCase("top-1, router weight on input", top_k=1, apply_router_weight_on_input=True, layout="standard", seed=3),
    EPCase("fp32 contiguous (tight tolerance)", dtype=torch.float32, top_k=3, seed=5),
    EPCase("-1 ids: padded tokens and slots", top_k=3, padded=True, seed=7),
    EPCase("-1 ids, masked", layout="masked", padded=True, seed=8),
    # Any layout, and a static bound: what a dispatcher of its own layout (Ascend HCCL's flat
    # one, which needs max_tokens) can take; every case above pins a core layout (session 45)
    EPCase("any layout, max_tokens 16, top-k spanning ranks, scaling 2.5", layout=None, max_tokens=16, top_k=4,
           routing="span_ranks", routed_scaling_factor=2.5),
    EPCase("w8a8_int8 any layout, max_tokens 16, uneven", quant="w8a8_int8", layout=None, max_tokens=16,
           routing="skewed", tokens_per_rank=(9, 2, 5)),
]  # fmt: skip


# --- inputs -----------------------------------------------------------------------------------


def _route(case: EPCase, total: int, world: int, g: torch.Generator) -> torch.Tensor:
    e, k = case.num_experts, case.top_k
    el = e // world
    ids = torch.empty(total, k, dtype=torch.int64)
    for t in range(total):
        if case.routing == "random":
            row = torch.randperm(e, generator=g)[:k]
        elif case.routing == "skewed":
            p = torch.ones(e)
            p[:el] = 20.0
            row = torch.multinomial(p, k, replacement=False, generator=g)
        elif case.routing == "avoid_last_rank":
            row = torch.randperm(e - el, generator=g)[:k]
        elif case.routing == "even_experts":
            row = torch.randperm(e // 2, generator=g)[:k] * 2
        elif case.routing == "span_ranks":
            ranks = torch.randperm(world, generator=g)
            row = torch.tensor([int(ranks[j % world]) * el + j // world for j in range(k)])
        elif case.routing == "same_rank":
            r = int(torch.randint(world, (1,), generator=g))
            row = r * el + torch.randperm(el, generator=g)[:k]
        else:
            raise ValueError(f"unknown routing pattern {case.routing!r}")
        ids[t] = row
    return ids


@dataclass
class EPInputs:
    x: torch.Tensor  # [T_total, H] all ranks' tokens, rank-major
    ids: torch.Tensor  # [T_total, K] global ids
    weights: torch.Tensor  # [T_total, K] fp32
    w13: torch.Tensor  # fp32 [E, N13, H] all experts
    w2: torch.Tensor  # fp32 [E, H, I]
    offsets: list[int]  # first token of each rank


def make_inputs(case: EPCase, world: int) -> EPInputs:
    """Deterministic global inputs: every rank builds the same tensors from the seed."""
    g = torch.Generator().manual_seed(case.seed)
    cfg = case.config()
    tokens = case.tokens(world)
    total = sum(tokens)
    h, i = case.hidden_size, case.intermediate_size
    x = torch.randn(total, h, generator=g).to(case.dtype)
    ids = _route(case, total, world, g)
    if case.padded:
        ids[::3] = -1
        ids[1::4, 0] = -1
    w = torch.rand(total, case.top_k, generator=g) + 0.1
    w = w / w.sum(1, keepdim=True) if case.top_k > 1 else w + 0.4
    w13 = torch.randn(case.num_experts, cfg.w13_rows, h, generator=g) / math.sqrt(h)
    w2 = torch.randn(case.num_experts, h, i, generator=g) / math.sqrt(i)
    offsets = [sum(tokens[:r]) for r in range(world)]
    return EPInputs(x, ids, w, w13, w2, offsets)


# --- running a case -----------------------------------------------------------------------------


@dataclass
class EPResult:
    case: str
    rank: int
    world: int
    ok: bool  # this rank's rows match
    all_ok: bool  # every rank's rows match (agreed over the group)
    tokens: int
    max_abs_err: float
    tolerance: str
    pipeline: str
    mode: str
    device: str
    seconds: float
    detail: str = ""
    declined: str = ""  # the backend declined the case (NoBackendError's summary), not a failure
    oracle: str = ""  # the pipeline of the reference layer the rows were checked against

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_registry(plugins: Sequence[tuple[str, str]] = (), settings: Settings | None = None) -> Registry:
    """The installed plugins, plus `plugins` ((backend name, module) pairs, e.g. a plugin under
    test that is not installed). The in-tree reference backend is added when moehal runs from
    a source tree without installed entry points (e.g. a copy on a GPU machine). `settings`:
    load with these, not this process's environment (a registry of the caller's own)."""
    reg = discover() if settings is None else discover(settings=settings)
    if "reference" in reg.loaded_backends() and not plugins:
        return reg
    reg = Registry(reg.settings)  # a fresh one: never register into the shared registry
    reg.load_entry_points()
    extra = list(plugins)
    if "reference" not in reg.loaded_backends():
        extra.insert(0, ("reference", "moehal.reference.plugin"))
    for name, module in extra:
        rec = reg.register(importlib.import_module(module), name, module=module)
        if rec.status != "loaded":
            raise RuntimeError(f"plugin {name!r} ({module}) failed to register: {rec.error}")
    return reg


def _registry_with(registry: Registry, dispatcher: str | None) -> Registry:
    if dispatcher is None:
        return registry
    reg = copy.copy(registry)
    reg.dispatchers = [d for d in registry.dispatchers if d.qualname == dispatcher]
    if not reg.dispatchers:
        known = sorted(d.qualname for d in registry.dispatchers)
        raise ValueError(f"dispatcher {dispatcher!r} is not registered; known: {known}")
    return reg


def oracle_layer(case: EPCase, quant: QuantScheme, device: torch.device, registry: Registry) -> MoELayer:
    """The single-process reference layer a case is checked against: reference experts and
    the reference dispatcher (`moehal.reference.oracle`: on a GPU a vendor's dispatcher would
    otherwise outrank `reference.local`), on `device`, for every rank's tokens at once."""
    from moehal.reference.oracle import reference_layer

    cfg_one = case.config().with_(max_tokens=None)  # the oracle takes every rank's tokens at once
    return reference_layer(cfg_one, quant, device, layout=case.layout, registry=registry)


def run_ep_case(
    case: EPCase,
    group: Any = None,
    *,
    device: torch.device | str | None = None,
    backend: str = "reference",
    dispatcher: str | None = "reference.torch_distributed",
    registry: Registry | None = None,
) -> EPResult:
    """Run `case` on this rank of `group` (default: the world group); every rank must call it.

    backend: whose experts run on each rank (the EP layer's `MoELayer(backend=...)`).
    dispatcher: force this dispatcher qualname (None: let selection pick the best EP one).
    The oracle is always the single-process reference layer on all tokens, same layout
    (`oracle_layer`: reference experts and dispatcher, whatever else is installed).
    Raises (never returns a result) when the layer raises on any rank; returns a result
    with `ok=False` when the numbers disagree.
    """
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    t0 = time.perf_counter()
    quant = QuantScheme.parse(case.quant)
    inp = make_inputs(case, world)
    cfg_ep = case.config(rank, world)
    cfg_one = case.config().with_(max_tokens=None)  # the oracle takes every rank's tokens at once
    full = quantize_weights(cfg_one, quant, inp.w13, inp.w2)
    reg = registry if registry is not None else default_registry()

    layer = MoELayer(
        cfg_ep,
        quant,
        backend=backend,
        device=dev,
        layout=case.layout,
        registry=_registry_with(reg, dispatcher),
        process_group=group,
    )
    layer.load_weights(local_slice(full, cfg_ep).to(dev))
    lo = inp.offsets[rank]
    hi = lo + case.tokens(world)[rank]
    x, ids, w = inp.x[lo:hi].to(dev), inp.ids[lo:hi].to(dev), inp.weights[lo:hi].to(dev)
    if case.fail_rank == rank:
        raise InjectedFault(f"rank {rank} fails on purpose before the forward of case {case.name!r}")
    out = layer(x, ids, w)

    ref_layer = oracle_layer(case, quant, dev, reg)
    ref_layer.load_weights(full.to(dev))
    ref_all = ref_layer(inp.x.to(dev), inp.ids.to(dev), inp.weights.to(dev)).float()
    ref = ref_all[lo:hi]

    # 2 ulps of the largest output: one rounding of each rank's partial sum to the layer dtype,
    # plus float32 sums in another order. fp32 layers get 2**-17 (GEMMs of other row counts may
    # accumulate in another order on GPUs).
    eps = max(torch.finfo(case.dtype).eps, 2.0**-17)
    scale = float(ref_all.abs().max()) if ref_all.numel() else 1.0
    rtol, atol = 2 * eps, 2 * eps * max(scale, 1e-6)
    detail = ""
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != case.dtype:
        ok, err = False, math.inf
        detail = f"output {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {case.dtype}"
    else:
        diff = (out.float() - ref).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        ok = bool(torch.isfinite(out.float()).all()) and bool((diff <= atol + rtol * ref.abs()).all())
        if not ok:
            detail = f"max |ep - ref| {err:.3g} > atol {atol:.3g} + rtol {rtol:.3g} * |ref|"
    bad = torch.tensor([0 if ok else 1], dtype=torch.int64, device=dev)
    dist.all_reduce(bad, group=group)
    return EPResult(
        case=case.name,
        rank=rank,
        world=world,
        ok=ok,
        all_ok=int(bad.item()) == 0,
        tokens=hi - lo,
        max_abs_err=err,
        tolerance=f"atol {atol:.2g} rtol {rtol:.2g}",
        pipeline=layer.plan.pipeline.name,
        mode=layer.plan.pipeline.execution_mode(layer.request),
        device=str(dev),
        seconds=time.perf_counter() - t0,
        detail=detail,
        oracle=ref_layer.plan.pipeline.name,
    )


def declined_result(case: EPCase, rank: int, world: int, device: str, exc: NoBackendError) -> EPResult:
    """The result of a case the backend declines (the same on every rank, no collective ran)."""
    return EPResult(
        case.name, rank, world, False, False, 0, math.nan, "-", "-", "-", device, 0.0, declined=str(exc).splitlines()[0]
    )


def run_ep_cases(
    rank: int,
    world: int,
    cases: Sequence[EPCase] | None = None,
    device: str = "cpu",
    backend: str = "reference",
    dispatcher: str | None = "reference.torch_distributed",
    plugins: Sequence[tuple[str, str]] = (),
    poison: bool = False,
    settings: Settings | None = None,
) -> list[EPResult]:
    """Run every case in order on this rank (the `run_spawned` worker for suites).

    plugins: extra (backend name, module) pairs to register besides the installed entry
    points, e.g. a plugin under test that is not installed.
    poison: run each case with fresh allocations poisoned (`moehal.poison`), as conformance does.
    settings: the parent's settings (a conformance run's `--emulate` among them), handed over as
    an argument; None: the rank reads its environment (`Settings.from_env`).
    """
    from moehal.poison import poisoned

    todo = list(cases) if cases is not None else ep_cases(world)
    reg = default_registry(plugins, settings)
    results = []
    for c in todo:
        try:
            with poisoned(poison):
                results.append(run_ep_case(c, device=device, backend=backend, dispatcher=dispatcher, registry=reg))
        except NoBackendError as exc:  # deterministic on every rank: raised before any collective
            results.append(
                EPResult(
                    c.name,
                    rank,
                    world,
                    False,
                    False,
                    0,
                    math.nan,
                    "-",
                    "-",
                    "-",
                    device,
                    0.0,
                    declined=str(exc).splitlines()[0],
                )
            )
    return results


# --- a local process group with bounded timeouts --------------------------------------------------


@dataclass
class RankOutcome:
    rank: int
    status: str  # 'ok', 'error' (raised), 'timeout' (no answer in time), 'died' (exited silently)
    result: Any = None
    error: str = ""
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned_worker(
    rank: int,
    world: int,
    port: int,
    pg_backend: str,
    op_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    status, payload, error = "ok", None, ""
    try:
        dist.init_process_group(
            pg_backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=op_timeout_s),
        )
        payload = fn(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then this rank dies
        status, error = "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    out.put((rank, status, payload, error, time.perf_counter() - t0))
    out.close()
    out.join_thread()
    if status == "ok":
        dist.destroy_process_group()
        return
    # Die without tearing the group down: peers blocked in a collective see their
    # connections close and raise, instead of waiting for a barrier that never comes.
    os._exit(1)


def run_spawned(
    world: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = 90.0,
    op_timeout_s: float = 30.0,
    pg_backend: str = "gloo",
) -> list[RankOutcome]:
    """Run `fn(rank, world, *args)` in `world` fresh processes joined by a `pg_backend` group
    on 127.0.0.1 (fn must be importable: a module-level function).

    Returns one outcome per rank, in rank order, within about `timeout_s` seconds whatever
    happens: collectives time out after `op_timeout_s`, a rank that raises exits at once (its
    peers' pending collectives then fail), and ranks still running at the deadline are killed
    and reported as 'timeout'.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_spawned_worker,
            args=(r, world, port, pg_backend, op_timeout_s, fn, args, out),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < world and time.monotonic() < deadline:
        try:
            rank, status, payload, error, secs = out.get(timeout=0.5)
            outcomes[rank] = RankOutcome(rank, status, payload, error, secs)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(r, "timeout" if p.exitcode in (None, -9) else "died", error=f"exit {p.exitcode}")
    return [outcomes[r] for r in range(world)]


# --- reports ------------------------------------------------------------------------------------


@dataclass
class CaseRow:
    case: str
    verdict: str  # PASS / FAIL / DECLINED
    max_abs_err: float
    pipeline: str
    mode: str
    detail: str = ""
    per_rank: list[str] = field(default_factory=list)
    oracle: str = ""


def summarize(results: Sequence[Sequence[EPResult]]) -> list[CaseRow]:
    """Results of every rank (`results[rank][case]`) -> one row per case."""
    rows = []
    for i, first in enumerate(results[0]):
        per = [rank_results[i] for rank_results in results]
        ok = all(r.ok and r.all_ok for r in per)
        verdict = "DECLINED" if first.declined else ("PASS" if ok else "FAIL")
        rows.append(
            CaseRow(
                case=first.case,
                verdict=verdict,
                max_abs_err=max(r.max_abs_err for r in per),
                pipeline=first.pipeline,
                mode=first.mode,
                detail=first.declined or "; ".join(f"rank {r.rank}: {r.detail}" for r in per if r.detail),
                per_rank=[f"{r.tokens} tok" for r in per],
                oracle=first.oracle,
            )
        )
    return rows


def to_markdown(rows: Sequence[CaseRow], title: str, header: str = "") -> str:
    lines = [f"# {title}", ""]
    if header:
        lines += [header, ""]
    lines += ["| case | verdict | max abs err | tokens per rank | pipeline | mode |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.verdict} | {r.max_abs_err:.3g} | {', '.join(r.per_rank)} | `{r.pipeline}` | {r.mode} |"
        )
    fails = [r for r in rows if r.verdict == "FAIL"]
    declined = [r for r in rows if r.verdict == "DECLINED"]
    passed = len(rows) - len(fails) - len(declined)
    lines += ["", f"{passed} of {len(rows)} cases passed, {len(declined)} declined by the backend."]
    oracles = sorted({r.oracle for r in rows if r.oracle})
    if oracles:
        lines.append("Checked against: " + ", ".join(f"`{o}`" for o in oracles) + ".")
    for r in fails:
        lines.append(f"- FAIL {r.case}: {r.detail}")
    for r in declined:
        lines.append(f"- declined {r.case}: {r.detail}")
    return "\n".join(lines) + "\n"


def with_fault(case: EPCase, rank: int) -> EPCase:
    """`case` with rank `rank` raising `InjectedFault` before its forward."""
    return replace(case, name=f"{case.name} (rank {rank} fails)", fail_rank=rank)
