"""Performance goals as data, checked against `moehal bench` rows.

A goal says which rows it covers (quant scheme, token range) and what one of their numbers must
reach: % of roofline, speed against a peer (SGLang's Triton fused MoE), fp8 against bf16, or
host time per eager call. `check_goals` gives one `GoalCheck` per covered cell (device,
backend, shape, token count) that the rows measured, with the value and `met`, `not met` or
`not measured` (e.g. no peer row in the run). A claim about a goal is then read off a table
computed from the committed JSON, never typed by hand:

    moehal bench --backends cuda,sglang --goals          # after the run, on its own rows
    moehal goals docs/device-runs/.../bench.json ...     # saved runs (fp8 and bf16 files merged per device)

`ISSUE_4_GOALS` are the CUDA backend's goals of issue #4. The CUDA-graph goal is not a number
of a row: `moehal bench` times replays wherever the pipeline captures (the `timing` column).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

# What a goal measures (`Goal.metric`):
PCT_ROOFLINE = "pct_roofline"  # the row's % of the roofline measured in the same run
VS_PEER = "vs_peer"  # the peer's time over ours, same shape, tokens and quant (1.2 = 1.2x faster)
VS_BF16 = "vs_bf16"  # our bf16 time over this row's (an fp8 row), same backend, shape, tokens
HOST_US = "host_graph_out_us"  # host us per eager call replaying graphs, inputs in place, out=
HOST_EAGER_US = "host_us"  # host us per plain eager call (no graphs)
# host us per call replaying graphs, inputs in place, out=, calls back to back (an engine's loop)
HOST_B2B_US = "host_graph_out_b2b_us"
METRICS = (PCT_ROOFLINE, VS_PEER, VS_BF16, HOST_US, HOST_EAGER_US, HOST_B2B_US)
PEERS = frozenset({"sglang"})  # backends that are another engine's kernels, never ours
PEER_PREFIXES = ("transformers:",)  # transformers' own experts functions (`moehal bench --backends peers`)


def is_peer(backend: str) -> bool:
    """Whether a bench row's backend is a peer (compared against, never checked against a goal)."""
    return backend in PEERS or backend.startswith(PEER_PREFIXES)


@dataclass(frozen=True)
class Goal:
    """One goal: rows of `quant` with `min_tokens` <= tokens <= `max_tokens` (None: no bound)
    must have `metric` >= `target` (<= where `at_most`, e.g. host time)."""

    name: str
    text: str  # as people state it
    quant: str
    min_tokens: int
    max_tokens: int | None
    metric: str
    target: float
    at_most: bool = False

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"goal {self.name!r}: unknown metric {self.metric!r}; one of {METRICS}")

    def covers(self, quant: str, tokens: int) -> bool:
        """Rows of this scheme, whatever their scale format (`fp8_block:ue8m0` is fp8_block)."""
        kind = quant.partition(":")[0]
        return kind == self.quant and self.min_tokens <= tokens <= (self.max_tokens or tokens)

    def met_by(self, value: float) -> bool:
        return value <= self.target if self.at_most else value >= self.target

    @property
    def tokens_text(self) -> str:
        return f"{self.min_tokens}+" if self.max_tokens is None else f"{self.min_tokens}-{self.max_tokens}"


ISSUE_4_GOALS: tuple[Goal, ...] = (
    Goal("decode_vs_peer", "1-8 tokens: no slower than SGLang's Triton path", "bf16", 1, 8, VS_PEER, 1.0),
    Goal("small_roofline", "16-128 tokens: at least 90% of roofline", "bf16", 16, 128, PCT_ROOFLINE, 90.0),
    Goal("prefill_roofline", "1024-4096 tokens: at least 75% of roofline", "bf16", 1024, 4096, PCT_ROOFLINE, 75.0),
    Goal("prefill_vs_peer", "1024-4096 tokens: at least 1.2x SGLang's tuned Triton path", "bf16", 1024, 4096,
         VS_PEER, 1.2),
    Goal("fp8_vs_bf16", "fp8 block-scale at 1024+ tokens: at least 1.5x the bf16 path", "fp8_block", 1024, None,
         VS_BF16, 1.5),
    Goal("host_graphs", "host time under 20 us per eager forward (graph replay, inputs in place, out=), "
         "1-128 tokens", "bf16", 1, 128, HOST_US, 20.0, at_most=True),
    Goal("host_eager", "host time under 20 us per plain eager forward (no graphs), 1-128 tokens", "bf16", 1, 128,
         HOST_EAGER_US, 20.0, at_most=True),
    # The same replays timed as an engine's loop makes them (`moehal.bench.host_time_back_to_back`):
    # `host_graphs` times each call right after a synchronize, which adds the host's resume time.
    Goal("host_graphs_b2b", "host time under 20 us per eager forward (graph replay, inputs in place, out=), "
         "calls back to back, 1-128 tokens", "bf16", 1, 128, HOST_B2B_US, 20.0, at_most=True),
)  # fmt: skip


@dataclass(frozen=True)
class GoalCheck:
    """One covered cell: `value` None where the rows cannot say (a peer or bf16 row missing).
    From rows of several rounds (`moehal bench --rounds`), `value` is the median of the rounds'
    values, `low` and `high` their range, and `rounds` how many gave one."""

    goal: Goal
    device: str
    backend: str
    shape: str
    tokens: int
    value: float | None
    low: float | None = None
    high: float | None = None
    rounds: int = 1

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.goal.met_by(self.value)

    @property
    def status(self) -> str:
        return {None: "not measured", True: "met", False: "not met"}[self.met]

    @property
    def value_text(self) -> str:
        if self.value is None:
            return "-"
        text = self._fmt(self.value)
        if self.rounds > 1 and self.low is not None and self.high is not None:
            text += f" ({self._fmt(self.low)}-{self._fmt(self.high)}, {self.rounds} rounds)"
        return text

    def _fmt(self, v: float) -> str:
        m = self.goal.metric
        if m == PCT_ROOFLINE:
            return f"{v:.0f}%"
        if m in (VS_PEER, VS_BF16):
            return f"{v:.2f}x"
        return f"{v:.1f} us"


def _plain(row: Any) -> Mapping[str, Any]:
    return asdict(row) if is_dataclass(row) and not isinstance(row, type) else row


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _round(row: Mapping[str, Any]) -> int:
    return int(row.get("round") or 0)  # runs from before `--rounds` hold one round


def _key(row: Mapping[str, Any]) -> tuple[str, str, str, int, int]:
    return row["backend"], row["quant"], row["shape"], int(row["tokens"]), _round(row)


def _value(g: Goal, r: Mapping[str, Any], by_key: Mapping[tuple, Mapping[str, Any]], peer: str) -> float | None:
    """Goal `g`'s number for row `r`; a ratio pairs it with the peer's or the bf16 row of its round."""
    backend, _, shape, tokens, rnd = _key(r)
    if g.metric not in (VS_PEER, VS_BF16):
        return _finite(r.get(g.metric))
    other = by_key.get(
        (peer, r["quant"], shape, tokens, rnd) if g.metric == VS_PEER else (backend, "bf16", shape, tokens, rnd)
    )
    theirs, mine = (_finite(other.get("time_us")) if other else None), _finite(r.get("time_us"))
    return theirs / mine if theirs and mine else None


def check_goals(
    rows: Iterable[Any], device: str = "", goals: Sequence[Goal] = ISSUE_4_GOALS, peer: str = "sglang"
) -> list[GoalCheck]:
    """Every goal against every cell (backend, shape, tokens) that it covers, from `moehal.bench.Row`
    objects or their JSON dicts, of every backend but the peers (`is_peer`: compared against, never
    checked). A ratio (against the peer, or fp8 against bf16) pairs rows of the same round, so a
    run of several rounds compares rows measured next to each other; the cell's value is then the
    median over its rounds."""
    plain = [_plain(r) for r in rows]
    by_key = {_key(r): r for r in plain}
    cells: dict[tuple[str, str, str, int], list[Mapping[str, Any]]] = {}
    for r in plain:
        cells.setdefault(_key(r)[:4], []).append(r)
    checks = []
    for g in goals:
        for (backend, quant, shape, tokens), rs in cells.items():
            if is_peer(backend) or not g.covers(quant, tokens):
                continue
            values = [v for v in (_value(g, r, by_key, peer) for r in rs) if v is not None]
            if not values:
                checks.append(GoalCheck(g, device, backend, shape, tokens, None, rounds=0))
                continue
            mid = statistics.median(values)
            checks.append(GoalCheck(g, device, backend, shape, tokens, mid, min(values), max(values), len(values)))
    return checks


def load_runs(paths: Iterable[str | Path]) -> dict[str, list[dict[str, Any]]]:
    """`moehal bench --out` JSON files -> rows per device (`ceilings.device`), so that one
    device's bf16 and fp8 runs are checked together. A device's later file that measured a cell
    (backend, scheme, shape, tokens) replaces every round of it: rounds of two runs never mix
    in one cell (a one-round rerun would otherwise replace round 0 of a three-round record and
    pair its rows with the older rounds' partners)."""
    runs: dict[str, dict[tuple, dict[int, dict[str, Any]]]] = {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        device = str(data.get("ceilings", {}).get("device", "?"))
        cells = runs.setdefault(device, {})
        fresh: dict[tuple, dict[int, dict[str, Any]]] = {}
        for r in data["rows"]:
            key = _key(r)
            fresh.setdefault(key[:4], {})[key[4]] = r
        cells.update(fresh)
    return {d: [r for rounds in cells.values() for r in rounds.values()] for d, cells in runs.items()}


def check_runs(paths: Iterable[str | Path], goals: Sequence[Goal] = ISSUE_4_GOALS) -> list[GoalCheck]:
    return [c for device, rows in load_runs(paths).items() for c in check_goals(rows, device, goals)]


@dataclass(frozen=True)
class GoalSummary:
    """One goal on one device and backend: how many measured cells met it, and which did not."""

    goal: Goal
    device: str
    backend: str
    met: int
    measured: int
    unmeasured: int
    misses: tuple[GoalCheck, ...]

    @property
    def status(self) -> str:
        if not self.measured:
            return "not measured"
        return "met" if self.met == self.measured else "not met"


def summarize(checks: Iterable[GoalCheck]) -> list[GoalSummary]:
    groups: dict[tuple[str, str, str], list[GoalCheck]] = {}
    order: list[Goal] = []
    for c in checks:
        groups.setdefault((c.goal.name, c.device, c.backend), []).append(c)
        if c.goal not in order:
            order.append(c.goal)
    out = []
    for g in order:
        for (name, device, backend), cs in groups.items():
            if name != g.name:
                continue
            measured = [c for c in cs if c.met is not None]
            misses = tuple(c for c in measured if not c.met)
            out.append(
                GoalSummary(g, device, backend, len(measured) - len(misses), len(measured), len(cs) - len(measured),
                            misses)
            )  # fmt: skip
    return out


def _misses_text(s: GoalSummary, sep: str = ", ") -> str:
    return sep.join(f"{c.shape} {c.tokens}: {c.value_text}" for c in s.misses)


def goals_markdown(checks: Sequence[GoalCheck], cells: bool = True) -> str:
    """The summary (one line per goal, device and backend) and then, with `cells`, every cell,
    as markdown."""
    lines = [
        "| goal | target | device | backend | status | cells met | where not met |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summarize(checks):
        g = s.goal
        met = f"{s.met} of {s.measured}" + (f" ({s.unmeasured} not measured)" if s.unmeasured else "")
        lines.append(f"| {g.text} | {_target_text(g)} | {s.device} | {s.backend} | {s.status} | {met} "
                     f"| {_misses_text(s) or '-'} |")  # fmt: skip
    if not cells:
        return "\n".join(lines) + "\n"
    lines += ["", "| goal | device | backend | shape | tokens | value | status |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(
            f"| {c.goal.name} | {c.device} | {c.backend} | {c.shape} | {c.tokens} | {c.value_text} | {c.status} |"
        )
    return "\n".join(lines) + "\n"


def _target_text(g: Goal) -> str:
    if g.metric == PCT_ROOFLINE:
        return f">= {g.target:.0f}%"
    if g.metric in (VS_PEER, VS_BF16):
        return f">= {g.target:g}x"
    return f"{'<=' if g.at_most else '>='} {g.target:g} us"


def goals_table(checks: Sequence[GoalCheck]) -> Any:
    """Rich tables, one per device and backend: a line per goal; the cells met, green where all
    of them are, red where some are not, yellow where none was measured."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    colour = {"met": "green", "not met": "red", "not measured": "yellow"}
    tables: dict[tuple[str, str], Table] = {}
    for s in summarize(checks):
        t = tables.get((s.device, s.backend))
        if t is None:
            t = Table(title=f"goals: {s.backend} on {escape(s.device)}", title_justify="left")
            tables[(s.device, s.backend)] = t
            for col in ("goal", "tokens", "target", "met"):
                t.add_column(col, no_wrap=True)
            t.add_column("where not met", overflow="fold", min_width=24)
        cells = f"{s.met}/{s.measured}" + (f" +{s.unmeasured} unmeasured" if s.unmeasured else "")
        t.add_row(
            s.goal.name, s.goal.tokens_text, _target_text(s.goal), f"[{colour[s.status]}]{cells}[/]",
            escape(_misses_text(s, "\n")) or "-",
        )  # fmt: skip
    return Group(*tables.values())
