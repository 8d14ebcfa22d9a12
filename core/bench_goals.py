"""Performance goals as data, checked against `moehal bench` rows.

A goal says which rows it covers (quant scheme, token range) and what one of their numbers must
reach: % of roofline, speed against a peer (SGLang's Triton fused MoE), fp8 against bf16, or
host time per eager call. `check_goals` gives one `GoalCheck` per covered cell (device,
backend, shape, token count) that the rows measured, with the value and `met`, `not met` or
`not measured` (e.g. no peer row in the run), or `untuned peer` (a ratio against a peer that ran
no tuned config: shown, never counted as met). `summarize` reads a goal as `met` only where every
cell of its range that the rows hold was measured and met; `partly measured` where the measured
cells met it but some were not measured. A claim about a goal is then read off a table computed
from the committed JSON, never typed by hand:

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

from moehal.errors import InputError

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
    # a ratio against the peer counts only where the peer ran a tuned config (`Row.peer_config`
    # "tuned", or "tuned for Triton X"): a cell against its default tiles reads `untuned peer`
    tuned_peer: bool = False
    # not a goal of the issue, shown beside them for what it tells (the host time of a graph
    # replay): its summary says "informational", and `moehal goals --check` does not gate on it
    informational: bool = False

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
    Goal("decode_vs_peer", "1-8 tokens: no slower than SGLang's Triton path", "bf16", 1, 8, VS_PEER, 1.0,
         tuned_peer=True),
    Goal("small_roofline", "16-128 tokens: at least 90% of roofline", "bf16", 16, 128, PCT_ROOFLINE, 90.0),
    Goal("prefill_roofline", "1024-4096 tokens: at least 75% of roofline", "bf16", 1024, 4096, PCT_ROOFLINE, 75.0),
    Goal("prefill_vs_peer", "1024-4096 tokens: at least 1.2x SGLang's tuned Triton path", "bf16", 1024, 4096,
         VS_PEER, 1.2, tuned_peer=True),
    Goal("fp8_vs_bf16", "fp8 block-scale at 1024+ tokens: at least 1.5x the bf16 path", "fp8_block", 1024, None,
         VS_BF16, 1.5),
    # The issue's host goal: a plain eager forward, no graph. (1-128 tokens: the decode sizes the
    # bench's host columns time; the issue names no range.)
    Goal("host_eager", "host overhead under 20 us per forward outside graphs (plain eager forward), 1-128 tokens",
         "bf16", 1, 128, HOST_EAGER_US, 20.0, at_most=True),
    # Informational, not the issue's: the host time of a forward that replays a CUDA graph
    # (`cuda_graph_tokens`; the work inside a graph), timed after a synchronize ...
    Goal("host_graphs", "informational: host time per replayed forward, inside a CUDA graph (replay, inputs in "
         "place, out=), under 20 us, 1-128 tokens", "bf16", 1, 128, HOST_US, 20.0, at_most=True, informational=True),
    # ... and as an engine's loop makes them, back to back (`moehal.bench.host_time_back_to_back`):
    # `host_graphs` times each call right after a synchronize, which adds the host's resume time.
    Goal("host_graphs_b2b", "informational: host time per replayed forward, inside a CUDA graph (replay, inputs "
         "in place, out=), calls back to back, under 20 us, 1-128 tokens", "bf16", 1, 128, HOST_B2B_US, 20.0,
         at_most=True, informational=True),
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
    # what a reader needs beside the value: the peer ran SGLang's default config, the pair came
    # from two files, the row was skipped (and why), ...; "" when nothing
    note: str = ""
    # a goal of `Goal.tuned_peer` whose value is only against a peer that ran no tuned config:
    # shown, but not a measurement of the goal (`met` None, status "untuned peer")
    untuned_peer: bool = False

    @property
    def met(self) -> bool | None:
        """Whether the cell meets its goal; None where it is not measured (no value, or only
        against an untuned peer)."""
        return None if self.value is None or self.untuned_peer else self.goal.met_by(self.value)

    @property
    def status(self) -> str:
        if self.untuned_peer and self.value is not None:
            return UNTUNED_PEER
        return {None: "not measured", True: "met", False: "not met"}[self.met]

    @property
    def value_text(self) -> str:
        return self.value_text_without()

    def value_text_without(self, notes: Iterable[str] = ()) -> str:
        """`value_text`, leaving out the notes in `notes` (said once for a whole goal)."""
        said = set(notes)
        note = "; ".join(n for n in self.note.split("; ") if n and n not in said)
        if self.value is None:
            return f"- ({note})" if note else "-"
        text = self._fmt(self.value)
        if self.rounds > 1 and self.low is not None and self.high is not None:
            text += f" ({self._fmt(self.low)}-{self._fmt(self.high)}, {self.rounds} rounds)"
        return f"{text} [{note}]" if note else text

    def _fmt(self, v: float) -> str:
        return format_value(self.goal, v)


# Digits a goal's values print with (`format_value`), and their unit
_DIGITS = {PCT_ROOFLINE: (0, "%"), VS_PEER: (2, "x"), VS_BF16: (2, "x")}
_EXTRA_DIGITS = 3  # at most this many more where the usual ones would print the other verdict


def format_value(goal: Goal, v: float) -> str:
    """`v` as a value of `goal`'s metric ("89%", "1.47x", "20.3 us"), never printed on the other
    side of the goal's target: 89.6 of a 90% goal prints "89.6%", not "90%" (next to "not met"),
    and 1.497 of a 1.5x goal "1.497x". Up to `_EXTRA_DIGITS` more digits are taken where the
    usual ones would cross the target; a value closer still is rounded toward its own side
    (89.99999 prints "89.999%")."""
    digits, unit = _DIGITS.get(goal.metric, (1, " us"))
    met = goal.met_by(v)
    for d in range(digits, digits + _EXTRA_DIGITS + 1):
        text = f"{v:.{d}f}"
        if goal.met_by(float(text)) == met:
            return text + unit
    # still on the other side at the most digits: round toward the value's own side (up where
    # a larger number keeps the verdict: a met ">=" goal, a missed "<=" goal)
    d = digits + _EXTRA_DIGITS
    up = met != goal.at_most
    directed = (math.ceil(v * 10**d) if up else math.floor(v * 10**d)) / 10**d
    if goal.met_by(directed) != met:  # float rounding landed on the target: one step further
        directed += (1 if up else -1) / 10**d
    return f"{directed:.{d}f}{unit}"


def _plain(row: Any) -> Mapping[str, Any]:
    return asdict(row) if is_dataclass(row) and not isinstance(row, type) else row


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _round(row: Mapping[str, Any]) -> int:
    return int(row.get("round") or 0)  # runs from before `--rounds` hold one round


def _key(row: Mapping[str, Any]) -> tuple[str, str, str, int, int]:
    return row["backend"], row["quant"], row["shape"], int(row["tokens"]), _round(row)


# Which file of a `load_runs` merge a row came from: a ratio pairs rows of one file, measured in
# one run on one machine (a device string does not tell two machines of one model apart)
RUN = "_run"
# A row `moehal bench` could not measure (`skipped`: why); its cell reads "not measured"
SKIPPED = "skipped"
# A row whose output failed the benchmark's check against the reference (`Row.check`): its time
# is no measurement, so its cell, and a ratio taken against it, read "not measured"
CHECK = "check"


def _wrong(r: Mapping[str, Any]) -> bool:
    return r.get(CHECK) == "fail"


def _wrong_note(r: Mapping[str, Any]) -> str:
    rel = _finite(r.get("check_rel_l2"))  # null in files since session 57 where it was NaN
    return f"{r['backend']} {r['quant']} output wrong (rel_l2 {rel if rel is not None else math.nan:.3g})"


# `GoalCheck.status` of a cell measured only against a peer that ran no tuned config
UNTUNED_PEER = "untuned peer"
# `GoalSummary.status` of a goal whose measured cells met it while others were not measured
PARTLY_MEASURED = "partly measured"


def _peer_tuned(peer_row: Mapping[str, Any]) -> bool | None:
    """Whether the peer ran a tuned config (`Row.peer_config`: "tuned", or "tuned for Triton X",
    SGLang's fallback to another Triton release's file); None where its row does not say
    (files before session 44)."""
    how = str(peer_row.get("peer_config") or "")
    return None if not how else how.startswith("tuned")


def _peer_note(peer_row: Mapping[str, Any]) -> str:
    """What the peer ran, where it was not its tuned config (`Row.peer_config`), or that its row
    does not say."""
    how = str(peer_row.get("peer_config") or "")
    if not how:
        return "peer config not recorded"
    return "" if how == "tuned" else f"peer config: {how}"


def _over_ceiling_note(r: Mapping[str, Any]) -> str:
    """For a % of roofline goal: that row `r` read above 100%, faster than its run's roofline (a
    ceiling set too low: `moehal.bench.OVER_CEILING_NOTE`), and whether the read ceiling's too."""
    pct = _finite(r.get(PCT_ROOFLINE))
    if pct is None or pct <= 100:
        return ""
    read = _finite(r.get("pct_roofline_read"))
    return "above 100% of roofline (ceiling exceeded" + (", the read ceiling's too)" if read and read > 100 else ")")


def _value(
    g: Goal, r: Mapping[str, Any], by_key: Mapping[tuple, Mapping[str, Any]], peer: str, across_files: bool
) -> tuple[float | None, str, bool]:
    """Goal `g`'s number for row `r`, a note, and whether it is against a peer that ran no tuned
    config (`_peer_tuned` False); a ratio pairs it with the peer's or the bf16 row of its round in
    its own file (in any file, noted, with `across_files`)."""
    backend, _, shape, tokens, rnd = _key(r)
    if g.metric == PCT_ROOFLINE:
        return _finite(r.get(g.metric)), _over_ceiling_note(r), False
    if g.metric not in (VS_PEER, VS_BF16):
        return _finite(r.get(g.metric)), "", False
    pair = (peer, r["quant"], shape, tokens, rnd) if g.metric == VS_PEER else (backend, "bf16", shape, tokens, rnd)
    other, note = by_key.get((*pair, r.get(RUN, 0))), ""
    if other is None and across_files:
        other = next((v for k, v in by_key.items() if k[:5] == pair), None)
        note = "rows of two files"
    if other is None:
        return None, "", False
    if SKIPPED in other:
        return None, f"{other['backend']} {other['quant']} row skipped: {other[SKIPPED]}", False
    if _wrong(other):
        return None, _wrong_note(other), False
    if r.get("timing") and other.get("timing") and r["timing"] != other["timing"]:
        return None, f"timed {r['timing']} against {other['timing']}", False
    untuned = False
    if g.metric == VS_PEER:
        note = "; ".join(n for n in (note, _peer_note(other)) if n)
        untuned = _peer_tuned(other) is False
    theirs, mine = _finite(other.get("time_us")), _finite(r.get("time_us"))
    return (theirs / mine if theirs and mine else None), note, untuned


def check_goals(
    rows: Iterable[Any],
    device: str = "",
    goals: Sequence[Goal] = ISSUE_4_GOALS,
    peer: str = "sglang",
    across_files: bool = False,
) -> list[GoalCheck]:
    """Every goal against every cell (backend, shape, tokens) that it covers, from `moehal.bench.Row`
    objects or their JSON dicts, of every backend but the peers (`is_peer`: compared against, never
    checked). A ratio (against the peer, or fp8 against bf16) pairs rows of the same round and
    file (`RUN`, set by `load_runs`), so a run of several rounds compares rows measured next to
    each other; the cell's value is then the median over its rounds. `across_files`: pair rows
    of two files of one device where a file lacks the partner (each such cell says so).
    Dicts with `SKIPPED` (rows the benchmark could not measure, and why) make their cells
    "not measured", with the reason, and so do rows whose output failed the benchmark's check
    (`CHECK`), as a side of a ratio too. A goal of `Goal.tuned_peer` takes the rounds against
    a tuned peer; a cell with none (the peer ran its default tiles) keeps its value, marked
    `untuned_peer` (status "untuned peer", never met)."""
    plain = [_plain(r) for r in rows]
    by_key = {(*_key(r), r.get(RUN, 0)): r for r in plain}
    cells: dict[tuple[str, str, str, int], list[Mapping[str, Any]]] = {}
    for r in plain:
        cells.setdefault(_key(r)[:4], []).append(r)
    checks = []
    for g in goals:
        for (backend, quant, shape, tokens), rs in cells.items():
            if is_peer(backend) or not g.covers(quant, tokens):
                continue
            measured = [r for r in rs if SKIPPED not in r and not _wrong(r)]
            if not measured:
                why = "; ".join(sorted({f"skipped: {r[SKIPPED]}" if SKIPPED in r else _wrong_note(r) for r in rs}))
                checks.append(GoalCheck(g, device, backend, shape, tokens, None, rounds=0, note=why))
                continue
            found = [_value(g, r, by_key, peer, across_files) for r in measured]
            values = [v for v, _, _ in found if v is not None]
            untuned = False
            if g.tuned_peer:
                tuned = [v for v, _, against_untuned in found if v is not None and not against_untuned]
                values, untuned = (tuned, False) if tuned else (values, bool(values))
            wrong = [_wrong_note(r) for r in rs if _wrong(r)]  # rounds left out: their output was wrong
            note = "; ".join(dict.fromkeys([*(n for _, n, _ in found if n), *wrong]))  # each once, in order
            if not values:
                checks.append(GoalCheck(g, device, backend, shape, tokens, None, rounds=0, note=note))
                continue
            mid = statistics.median(values)
            checks.append(
                GoalCheck(g, device, backend, shape, tokens, mid, min(values), max(values), len(values), note, untuned)
            )
    return checks


# The JSON format of `moehal bench --out`: its name, and the version a reader checks (a new
# version only where a field changes meaning or goes; added fields keep it). Files written
# before session 59 have no `schema`: they are read as version 1.
BENCH_SCHEMA = "moehal.bench/1"
BENCH_SCHEMA_NAME = BENCH_SCHEMA.split("/")[0]


def read_bench_json(path: str | Path) -> Any:
    """The parsed JSON of the `moehal bench --out` file `path`, whose `schema`, where it names
    one, must be `BENCH_SCHEMA` (InputError otherwise: a later moehal's format, or another
    command's file); files without it (before session 59) are version 1. OSError and ValueError
    (no file, no JSON) as reading and parsing raise them; the fields are the caller's to check."""
    data = json.loads(Path(path).read_text())
    schema = data.get("schema", BENCH_SCHEMA) if isinstance(data, dict) else BENCH_SCHEMA
    if schema != BENCH_SCHEMA:
        raise InputError(
            f"{path}: schema {schema!r}, not {BENCH_SCHEMA!r}: not a `moehal bench --out` file this moehal "
            "reads (a later moehal's format, or another command's file)"
        )
    return data


def load_runs(paths: Iterable[str | Path]) -> dict[str, list[dict[str, Any]]]:
    """`moehal bench --out` JSON files (`read_bench_json`) -> rows per device (`ceilings.device`), so that one
    device's bf16 and fp8 runs are checked together. Each row keeps which file it came from
    (`RUN`): ratios pair rows of one file. A device's later file that measured a cell
    (backend, scheme, shape, tokens) replaces every round of it: rounds of two runs never mix
    in one cell (a one-round rerun would otherwise replace round 0 of a three-round record and
    pair its rows with the older rounds' partners). A file's skipped rows (`SKIPPED`) stand in
    for cells that no file measured."""
    runs: dict[str, dict[tuple, dict[int, dict[str, Any]]]] = {}
    skips: dict[str, dict[tuple, dict[int, dict[str, Any]]]] = {}
    for i, p in enumerate(paths):
        try:
            data = read_bench_json(p)
            device = str(data.get("ceilings", {}).get("device", "?"))
            for source, into in ((data["rows"], runs), (data.get(SKIPPED, []), skips)):
                fresh: dict[tuple, dict[int, dict[str, Any]]] = {}
                for r in source:
                    key = _key(r)
                    fresh.setdefault(key[:4], {})[key[4]] = {**r, RUN: i}
                into.setdefault(device, {}).update(fresh)
        except InputError:  # a schema this moehal does not read: its own words
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a wrong path, or no bench file
            raise InputError(f"{p} is not a readable `moehal bench --out` JSON file: {exc!r}") from exc
    out: dict[str, list[dict[str, Any]]] = {}
    for device in dict.fromkeys([*runs, *skips]):  # in the files' order
        cells = runs.get(device, {})
        unmeasured = {k: v for k, v in skips.get(device, {}).items() if k not in cells}
        out[device] = [r for group in (cells, unmeasured) for rounds in group.values() for r in rounds.values()]
    return out


def check_runs(
    paths: Iterable[str | Path], goals: Sequence[Goal] = ISSUE_4_GOALS, across_files: bool = False
) -> list[GoalCheck]:
    return [
        c
        for device, rows in load_runs(paths).items()
        for c in check_goals(rows, device, goals, across_files=across_files)
    ]


@dataclass(frozen=True)
class GoalSummary:
    """One goal on one device and backend: how many measured cells met it, and which did not.
    `status`: "met" only where every cell the rows hold was measured and met; "partly measured"
    where the measured cells met it and some were not measured (no peer row, a skipped or wrong
    row, an untuned peer); "not met" where a measured cell missed; "not measured" where none was
    measured. ("met" is still only as wide as the token counts the rows hold.)"""

    goal: Goal
    device: str
    backend: str
    met: int
    measured: int
    unmeasured: int  # cells not measured, `untuned` included
    misses: tuple[GoalCheck, ...]
    # the cells' notes (`GoalCheck.note`: why one is not measured, what one was measured against)
    # and how many cells carry each
    notes: tuple[tuple[str, int], ...] = ()
    untuned: int = 0  # cells measured only against an untuned peer (`GoalCheck.untuned_peer`)

    @property
    def status(self) -> str:
        if not self.measured:
            return "not measured"
        if self.met < self.measured:
            return "not met"
        return PARTLY_MEASURED if self.unmeasured else "met"

    @property
    def status_text(self) -> str:
        """`status` as the tables print it: "(informational)" after an informational goal's."""
        return f"{self.status} (informational)" if self.goal.informational else self.status

    @property
    def cells_text(self) -> str:
        """The cells: "M of N" (measured cells met), and those not measured: "(K not measured, J of them
        against an untuned peer)"."""
        text = f"{self.met} of {self.measured}"
        if self.unmeasured:
            untuned = f", {self.untuned} of them against an untuned peer" if self.untuned else ""
            text += f" ({self.unmeasured} not measured{untuned})"
        return text


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
            notes: dict[str, int] = {}
            for c in cs:
                for n in filter(None, c.note.split("; ")):
                    notes[n] = notes.get(n, 0) + 1
            out.append(
                GoalSummary(g, device, backend, len(measured) - len(misses), len(measured), len(cs) - len(measured),
                            misses, tuple(notes.items()), sum(c.untuned_peer for c in cs))
            )  # fmt: skip
    return out


def _notes_text(s: GoalSummary) -> str:
    return "".join(f"; {n} in {k} of {s.measured + s.unmeasured}" for n, k in s.notes)


def _misses_text(s: GoalSummary, sep: str = ", ") -> str:
    """The cells not met, each without the notes that every cell of the goal carries (said once)."""
    everywhere = [n for n, k in s.notes if k == s.measured + s.unmeasured]
    return sep.join(f"{c.shape} {c.tokens}: {c.value_text_without(everywhere)}" for c in s.misses)


def goals_markdown(checks: Sequence[GoalCheck], cells: bool = True) -> str:
    """The summary (one line per goal, device and backend) and then, with `cells`, every cell,
    as markdown."""
    lines = [
        "| goal | target | device | backend | status | cells met | where not met |",
        "|---|---|---|---|---|---|---|",
    ]
    from moehal.cli.markdown import cell  # a device name, a backend's skip reason, a peer's error

    for s in summarize(checks):
        g = s.goal
        met = s.cells_text + _notes_text(s)
        theirs = (s.device, s.backend, s.status_text, met, _misses_text(s) or "-")
        lines.append("| " + " | ".join([g.text, _target_text(g), *map(cell, theirs)]) + " |")
    if not cells:
        return "\n".join(lines) + "\n"
    lines += ["", "| goal | device | backend | shape | tokens | value | status |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        theirs = (c.device, c.backend, c.shape, c.tokens, c.value_text, c.status)
        lines.append("| " + " | ".join([c.goal.name, *map(cell, theirs)]) + " |")
    return "\n".join(lines) + "\n"


def _target_text(g: Goal) -> str:
    if g.metric == PCT_ROOFLINE:
        text = f">= {g.target:.0f}%"
    elif g.metric in (VS_PEER, VS_BF16):
        text = f">= {g.target:g}x"
    else:
        text = f"{'<=' if g.at_most else '>='} {g.target:g} us"
    return text


def goals_table(checks: Sequence[GoalCheck]) -> Any:
    """Rich tables, one per device and backend: a line per goal, its status (`GoalSummary.status`)
    and cells; green where met, red where not met, yellow where partly or not measured. Fitted to the console
    (`moehal.cli.tables.FittedTable`): no value is cut, the notes move to a table of their own
    where the console is too narrow for them beside the rest."""
    from moehal.cli.tables import FittedTable
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    colour = {"met": "green", "not met": "red", PARTLY_MEASURED: "yellow", "not measured": "yellow"}
    tables: dict[tuple[str, str], Table] = {}
    for s in summarize(checks):
        t = tables.get((s.device, s.backend))
        if t is None:
            t = Table(title=f"goals: {s.backend} on {escape(s.device)}", title_justify="left")
            tables[(s.device, s.backend)] = t
            for col in ("goal", "tokens", "target", "status", "cells met"):
                t.add_column(col, no_wrap=True)
            t.add_column("where not met, and notes", overflow="fold", min_width=24)
        cells = f"{s.met}/{s.measured}" + (f" +{s.unmeasured} unmeasured" if s.unmeasured else "")
        notes = [f"{n} in {k} of {s.measured + s.unmeasured}" for n, k in s.notes]
        if s.untuned:
            notes.append(f"{s.untuned} of the unmeasured against an untuned peer")
        t.add_row(
            s.goal.name, s.goal.tokens_text, _target_text(s.goal), f"[{colour[s.status]}]{s.status_text}[/]", cells,
            escape("\n".join([_misses_text(s, "\n"), *notes]).strip()) or "-",
        )  # fmt: skip
    return Group(*(FittedTable(t, keys=1) for t in tables.values()))
