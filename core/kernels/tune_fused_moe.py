"""Tune the portable Triton fused MoE (`moehal.kernels.triton_fused_moe`) on this GPU: the table
its `select_configs` reads, per expert shape and token count.

    python -m moehal.kernels.tune_fused_moe --shapes qwen3_30b_a3b,mixtral_8x7b \\
        --tokens 1,16,128,1024,4096 --quant bf16 [--out triton_fused_moe.<device-slug>.json]

Why: without a table the kernel runs heuristic tiles. Tuned tiles decide how close a Triton
fused MoE gets to its roofline (SGLang's Triton fused MoE reaches 90-100% where it ships tuned
configs and 23-33% where it does not, issue #4), and the ROCm backend runs this kernel on every
AMD GPU, where no table ships. Vendors and users tune on their own hardware with this module.

How: for each shape (`moehal.bench.SHAPES`) and token count, on the benchmark's routing
(`moehal.bench.bench_inputs`), the whole fused forward is timed as `moehal bench` times a row
(`moehal.bench.time_call`, CUDA-graph replays on a GPU), after `SETTLE_S` (0.5 s) of the same
work rather than the bench's 2 s: candidates are compared with each other, and 2 s each would
cut the search by three.
The heuristic pair is the first candidate, so an entry is never slower than the heuristic (the
JSON keeps both times); seeds (`--seed`, or `--seed-config` with another engine's shipped
config file, its tiles translated to this kernel's convention by `EngineConfig.seed`) come
next, and a seed that beats the heuristic is refined one setting at a time. Then per tile
height (BLOCK_M, which both GEMMs share), GEMM1's tile is searched with GEMM2's at the
heuristic's, then GEMM2's with GEMM1's at the best found; the time budget is shared out over
the heights, so a short one still reaches the tall tiles.
Every candidate's output is compared with the heuristic's: a tile that computes something else
(or fails to compile or launch) is rejected and counted, never chosen.

The result loads with `moehal.kernels.triton_fused_moe.register_tuned_configs(device_name,
table)`, or as `triton_fused_moe.<device-slug>.json` beside that module.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from moehal.kernels.tiles import TileConfig, nearest_count

# The GEMMs' candidate tiles, per tile height: N and K blocks, then (warps, stages) pairs.
_BLOCK_N = (64, 128, 256)
_BLOCK_K = (64, 128)
_WARPS_STAGES_NV = ((4, 3), (4, 4), (8, 3), (8, 4))
_WARPS_STAGES_ROCM = ((4, 2), (8, 2))  # AMD's stream pipeliner wants num_stages=2
# Largest error (max |diff| / max |ref|) against the heuristic tile's output: tiles only change
# the order of fp32 accumulation, so anything above these computed something else.
_TOLERANCE = {"none": 3e-2, "fp8_block": 6e-2, "fp8_tensor": 6e-2, "int8": 6e-2}


def block_heights(rows_per_expert: float) -> tuple[int, ...]:
    """Tile heights worth trying for this many routed rows per expert (the kernel pads each
    expert's rows to a multiple of BLOCK_M)."""
    if rows_per_expert <= 16:
        return (16, 32)
    if rows_per_expert <= 64:
        return (16, 32, 64)
    if rows_per_expert <= 256:
        return (32, 64, 128)
    return (64, 128)


def gemm_candidates(block_m: int, rows_per_expert: float, is_rocm: bool, tma: bool = False) -> list[TileConfig]:
    """One GEMM's tiles at height `block_m` (`select_configs` clamps them to the problem);
    with `tma` (a GPU whose weights TMA can read) each also with its weight tiles by TMA."""
    group_m = 1 if rows_per_expert <= 16 else 8  # grouped order pays where M tiles share weights
    pairs = _WARPS_STAGES_ROCM if is_rocm else _WARPS_STAGES_NV
    loads = (False, True) if tma else (False,)
    return [
        TileConfig(block_m, bn, bk, group_m, w, s, t)
        for bn in _BLOCK_N
        for bk in _BLOCK_K
        for w, s in pairs
        for t in loads
    ]


def neighbours(
    pair: tuple[TileConfig, TileConfig], is_rocm: bool, tma: bool = False
) -> list[tuple[TileConfig, TileConfig]]:
    """The pairs one step from `pair`: one GEMM's tile with one setting changed (its warps and
    stages to another of the GPU's pairs, its K block, its N block halved or doubled, grouped
    order on or off, TMA on or off where allowed); the tile height, which both share, is kept."""
    ws = _WARPS_STAGES_ROCM if is_rocm else _WARPS_STAGES_NV
    out: list[tuple[TileConfig, TileConfig]] = []
    for j, c in enumerate(pair):
        steps = [replace(c, num_warps=w, num_stages=s) for w, s in ws if (w, s) != (c.num_warps, c.num_stages)]
        steps += [replace(c, block_k=k) for k in _BLOCK_K if k != c.block_k]
        steps += [replace(c, block_n=n) for n in (c.block_n // 2, c.block_n * 2) if 16 <= n <= max(_BLOCK_N)]
        steps.append(replace(c, group_m=8 if c.group_m == 1 else 1))
        if tma or c.tma:
            steps.append(replace(c, tma=not c.tma))
        out += [(v, pair[1]) if j == 0 else (pair[0], v) for v in steps]
    return out


@dataclass
class Entry:
    """One tuned (shape, token count): the table entry and how it was found."""

    gemm1: TileConfig
    gemm2: TileConfig
    us: float
    heuristic_us: float
    tried: int
    rejected: dict[str, int]  # why -> how many: 'wrong output', or the Triton error's type

    def as_table_entry(self) -> dict[str, Any]:
        return {
            "gemm1": self.gemm1.as_dict(),
            "gemm2": self.gemm2.as_dict(),
            "us": round(self.us, 2),
            "heuristic_us": round(self.heuristic_us, 2),
            "tried": self.tried,
            "rejected": self.rejected,
        }


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


def tune_entry(
    run: Callable[[tuple[TileConfig, TileConfig]], torch.Tensor],
    heuristic: tuple[TileConfig, TileConfig],
    rows_per_expert: float,
    time_fn: Callable[[Callable[[], Any]], float],
    quant: str = "none",
    is_rocm: bool = False,
    budget_s: float = math.inf,
    max_candidates: int | None = None,
    on_candidate: Callable[[], None] | None = None,
    seeds: Sequence[tuple[TileConfig, TileConfig]] = (),
    clock: Callable[[], float] = time.perf_counter,
    tma: bool = False,
    log: Callable[[tuple[TileConfig, TileConfig], float, str | None], None] | None = None,
) -> Entry:
    """Search (GEMM1, GEMM2) tiles for one problem.

    run(configs) runs the forward with these tiles and returns its output; time_fn(fn) returns
    seconds per call of `fn`. `seeds` (e.g. another engine's shipped tiles) are measured right
    after the heuristic. The budget (`budget_s` seconds) is shared out over the tile heights,
    what one height leaves unused going to the next, half of a height's share to each GEMM's
    search: a short budget still looks at every height, not only the first. A seed that beats
    the heuristic is first refined (`neighbours`, hill-climbing in a third of the budget).
    `max_candidates` caps the candidates per GEMM and height, and the climb's steps. The best
    pair found so far is kept. `log(pair, seconds, why)` hears every candidate: its time, or
    inf and why it was rejected.
    """
    from triton.runtime.errors import TritonError  # compile errors, PTXAS, out of shared memory

    t0 = clock()
    ref = run(heuristic)  # outside the catch below: a problem that fails here is the caller's to see
    tol = _TOLERANCE[quant]
    tried = 0
    rejected: dict[str, int] = {}

    def measure(pair: tuple[TileConfig, TileConfig]) -> float:
        nonlocal tried
        tried += 1
        if on_candidate is not None:
            on_candidate()
        why = None
        try:
            y = run(pair)
            if _rel_err(y, ref) > tol:
                why = "wrong output"
        except TritonError as exc:  # a tile that does not compile or fit on this GPU
            why = type(exc).__name__
        t = math.inf if why else time_fn(lambda: run(pair))
        if why:
            rejected[why] = rejected.get(why, 0) + 1
        if log is not None:
            log(pair, t, why)
        return t

    best, best_t = heuristic, measure(heuristic)
    heuristic_t = best_t
    for seed in seeds:
        if seed != heuristic and clock() - t0 <= budget_s:
            t = measure(seed)
            if t < best_t:
                best, best_t = seed, t
    if best != heuristic:
        # A seed won. Other engines' tiles lie off this search's grid (their grouping, their N
        # blocks), so the sweep below would not look near it: climb from it one setting at a
        # time, within the first third of the budget.
        seen, improved, steps = {heuristic, *seeds}, True, 0
        while improved:
            improved = False
            for pair in neighbours(best, is_rocm, tma):
                if clock() - t0 > budget_s / 3 or (max_candidates is not None and steps >= max_candidates):
                    break
                if pair in seen:
                    continue
                seen.add(pair)
                steps += 1
                t = measure(pair)
                if t < best_t:
                    best, best_t, improved = pair, t, True
    heights = block_heights(rows_per_expert)
    for j, bm in enumerate(heights):
        start = clock()
        share = (t0 + budget_s - start) / (len(heights) - j)
        g1_end, g2_end = start + share / 2, start + share
        g1_base, g2_base = _at_height(heuristic, bm)
        cands = gemm_candidates(bm, rows_per_expert, is_rocm, tma)[:max_candidates]
        g1_best, t1 = g1_base, math.inf
        for g1 in cands:  # GEMM1's tile, GEMM2 at the heuristic's tile of this height
            if clock() > g1_end:
                break
            t = measure((g1, g2_base))
            if t < t1:
                g1_best, t1 = g1, t
        pair, t_pair = (g1_best, g2_base), t1
        for g2 in cands:  # then GEMM2's, GEMM1 at the best found
            if clock() > g2_end:
                break
            t = measure((g1_best, g2))
            if t < t_pair:
                pair, t_pair = (g1_best, g2), t
        if t_pair < best_t:
            best, best_t = pair, t_pair
    return Entry(best[0], best[1], best_t * 1e6, heuristic_t * 1e6, tried, rejected)


def nearest_tile(config: dict[str, Any], tokens: int) -> TileConfig:
    """The tile a vLLM / SGLang fused-MoE config file (token count -> tile) gives `tokens`:
    the entry at the nearest token count, as those engines pick it."""
    return TileConfig.from_dict(config[nearest_count(config, tokens)])


@dataclass(frozen=True)
class EngineConfig:
    """Another engine's fused-MoE config files for one shape, as seeds: `up` for GEMM1 and
    `down` (SGLang's `..._down.json`, absent in vLLM) for GEMM2, where given; else `up` for both."""

    up: dict[str, Any]
    down: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: Path) -> EngineConfig:
        """`path` and, where it exists beside it, its `<stem>_down.json` (SGLang's convention)."""
        down = path.with_name(f"{path.stem}_down{path.suffix}")
        return cls(json.loads(path.read_text()), json.loads(down.read_text()) if down.is_file() else None)

    def seed(self, tokens: int, gated: bool) -> tuple[TileConfig, TileConfig]:
        """(GEMM1, GEMM2) tiles in this kernel's convention. vLLM's and SGLang's GEMM1 writes the
        `[rows, 2I]` gate-and-up product, one N tile spanning both halves' columns; ours counts
        the columns of one half (its gate and up tiles side by side, the activation in the
        epilogue), so their N tile of a gated GEMM1 is our `BLOCK_N / 2` (same registers, same
        shared memory)."""
        g1 = nearest_tile(self.up, tokens)
        if gated:
            g1 = replace(g1, block_n=max(16, g1.block_n // 2))
        return g1, nearest_tile(self.down if self.down is not None else self.up, tokens)


def parse_tile(text: str) -> TileConfig:
    """'BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,num_warps,num_stages' (the last three optional)."""
    parts = [int(p) for p in text.split(",")]
    if not 3 <= len(parts) <= 6:
        raise ValueError(f"a tile is 3 to 6 comma-separated integers, got {text!r}")
    return TileConfig(*parts)


def _at_height(pair: tuple[TileConfig, TileConfig], block_m: int) -> tuple[TileConfig, TileConfig]:
    g1, g2 = pair
    return (
        replace(g1, block_m=block_m),
        replace(g2, block_m=block_m),
    )


def _problem(shape: str, quant_name: str, tokens: int, dev: torch.device) -> tuple[Any, ...]:
    """The fused kernel's inputs for one benchmark row: (hidden, ids, weights, TritonMoEWeights, cfg)."""
    import moehal
    from moehal.bench import SHAPES, _weights, bench_inputs
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.kernels.triton_experts import TritonWeightProcessor
    from moehal.quant import QuantScheme

    quant = QuantScheme.parse(quant_name)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=tokens, dtype=dtype)
    _, _, weights = _weights(shape, cfg, quant, dev)
    w = TritonWeightProcessor(devices=frozenset({dev.type})).process(weights, BuildRequest(cfg, quant, detect(dev)))
    x, ids, wts = bench_inputs(cfg, tokens)
    return x.to(dev, dtype), ids.to(dev, torch.int32), wts.to(dev), w, cfg


def _runner(
    k: Any, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: Any, cfg: Any, kquant: str, is_rocm: bool
) -> Callable[[tuple[TileConfig, TileConfig]], torch.Tensor]:
    """The fused forward of one problem with the given (GEMM1, GEMM2) tiles, clamped as
    `select_configs` clamps a table's entry."""
    h, i = cfg.hidden_size, cfg.intermediate_size

    def run(pair: tuple[TileConfig, TileConfig]) -> torch.Tensor:
        configs = (k._fit(pair[0], i, h, kquant), k._fit(pair[1], h, i, kquant))
        return k.fused_moe(
            x, ids, wts, w, activation=cfg.activation.value, gated=cfg.gated, out_dtype=cfg.dtype,
            all_local=True, configs=configs, is_rocm=is_rocm,
        )  # fmt: skip

    return run


def tune(
    shapes: Sequence[str],
    tokens: Sequence[int],
    quant_name: str,
    dev: torch.device,
    budget_s: float = 120.0,
    reps: int = 10,
    settle_s: float | None = None,
    max_candidates: int | None = None,
    progress: Any = None,
    seed_tiles: Sequence[TileConfig] = (),
    seed_configs: Sequence[EngineConfig] = (),
    trace: Path | None = None,
) -> dict[str, Any]:
    """Tune every (shape, token count); returns the table (`select_configs`' format).

    seed_tiles: tiles tried first for both GEMMs, in this kernel's convention (a gated GEMM1's
    `BLOCK_N` counts the columns of one half). seed_configs: vLLM / SGLang fused-MoE configs,
    whose tiles at the nearest token count, as those engines pick them, are tried first
    (translated by `EngineConfig.seed`). trace: a JSON-lines file that gets one line per
    candidate (shape, tokens, both tiles, its microseconds or why it was rejected)."""
    from moehal.bench import SETTLE_S, time_call
    from moehal.graphs import capture
    from moehal.kernels import triton_fused_moe as k

    is_rocm = torch.version.hip is not None
    settle = SETTLE_S if settle_s is None else settle_s

    def time_fn(fn: Callable[[], Any]) -> float:
        if dev.type == "cuda":  # graph replays, as `moehal bench` times a capturable forward
            graph, _ = capture(fn, dev)
            return time_call(graph.replay, dev, reps, warmup_s=settle, per_sample=10)
        return time_call(fn, dev, reps, warmup=1, warmup_s=settle)

    table: dict[str, Any] = {}
    for shape in shapes:
        for t in tokens:
            x, ids, wts, w, cfg = _problem(shape, quant_name, t, dev)
            kquant = w.quant  # the kernel's name for the scheme: 'none', 'fp8_block', 'fp8_tensor' or 'int8'
            e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
            dname = k._DTYPE_NAMES[cfg.dtype]
            heuristic = k.select_configs(t, e, h, i, cfg.top_k, kquant, dname, None, is_rocm)
            key = k.table_key(e, h, i, dname if kquant == "none" else kquant)  # as `select_configs` looks up
            run = _runner(k, x, ids, wts, w, cfg, kquant, is_rocm)
            rows = t * cfg.top_k / e
            # TMA weight loads are candidates where this GPU and these weights allow them.
            tma = dev.type == "cuda" and k.tma_weights_ok(w.w13, heuristic[0], w.w13_paired)
            tma = tma and k.tma_weights_ok(w.w2, heuristic[1])
            task, advance = None, None
            if progress is not None:
                heights = block_heights(rows)
                per_height = [len(gemm_candidates(bm, rows, is_rocm, tma)[:max_candidates]) for bm in heights]
                total = 1 + len(seed_tiles) + len(seed_configs) + 2 * sum(per_height)
                total += len(neighbours(heuristic, is_rocm, tma)) if seed_tiles or seed_configs else 0  # one climb step
                task = progress.add_task(f"{shape} {quant_name} T={t}", total=total)
                advance = lambda task=task: progress.advance(task)  # noqa: E731
            pairs = [*((c, c) for c in seed_tiles), *(sc.seed(t, cfg.gated) for sc in seed_configs)]
            seeds = [(k._fit(g1, i, h, kquant), k._fit(g2, h, i, kquant)) for g1, g2 in pairs]
            log = _trace_logger(trace, shape, t) if trace is not None else None
            entry = tune_entry(
                run, heuristic, rows, time_fn, kquant, is_rocm, budget_s, max_candidates, advance, seeds, tma=tma,
                log=log,
            )  # fmt: skip
            if task is not None:
                progress.remove_task(task)
            table.setdefault(key, {})[str(t)] = entry.as_table_entry()
    return table


def _trace_logger(
    path: Path, shape: str, tokens: int
) -> Callable[[tuple[TileConfig, TileConfig], float, str | None], None]:
    """`tune_entry`'s `log`, appending one JSON line per candidate to `path` (its folder made
    here: `outputs_problem` checked it before the run and made nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(pair: tuple[TileConfig, TileConfig], secs: float, why: str | None) -> None:
        line: dict[str, Any] = {
            "shape": shape,
            "tokens": tokens,
            "gemm1": pair[0].as_dict(),
            "gemm2": pair[1].as_dict(),
        }
        line.update({"us": round(secs * 1e6, 2)} if why is None else {"rejected": why})
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    return log


def _table_or_none(path: Path) -> dict[str, Any] | None:
    """The tuned table in the existing file `path` (a JSON object of `table_key` entries and
    `_meta`, as this tuner writes it); None where the file is anything else."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        return None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        return None
    if not all(k == "_meta" or (k.startswith("E=") and ",dtype=" in k) for k in data):
        return None
    return data


def _is_trace(path: Path) -> bool:
    """Whether the existing file `path` is a `--trace` file: empty, or JSON lines of candidates."""
    try:
        with path.open(encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return all(isinstance(x, dict) and "shape" in x and "tokens" in x for x in lines)


def outputs_problem(out: Path, trace: Path | None) -> str | None:
    """Why `--out` (merged into) or `--trace` (appended to) could not be written, found before
    the run of minutes to hours whose table would then be lost; None where they can. A file
    already there must be this tuner's table (`--out`) or trace (`--trace`): a README or a JSON
    list was merged into, or crashed the merge after the whole run. Makes nothing: the table's
    folder is made when it is written (`replace_file`), the trace's by `_trace_logger`."""
    from moehal.cli.common import output_problem

    why = output_problem([out], lambda f: _table_or_none(f) is not None, "a tune_fused_moe table")
    if why is None and trace is not None:
        why = output_problem([trace], _is_trace, "a tune_fused_moe --trace file")
    return why


def _meta(dev: torch.device, settle_s: float) -> dict[str, Any]:
    import triton

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET)"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settle_s": settle_s,
        "note": "per (shape, tokens): the tiles, the fused forward's time with them and with the heuristic's",
    }


def main(argv: Sequence[str] | None = None) -> int:
    from moehal.bench import SETTLE_S, SHAPES
    from moehal.cli.common import make_console, replace_file
    from moehal.hardware import device_slug
    from rich.markup import escape
    from rich.progress import Progress

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])  # (python -OO strips docstrings)
    ap.add_argument("--shapes", default="qwen3_30b_a3b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--tokens", default="1,16,128,1024,4096")
    ap.add_argument(
        "--quant", default="bf16", choices=("bf16", "fp8_block", "fp8_block:ue8m0", "fp8_tensor", "w8a8_int8")
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=120.0, help="seconds per (shape, tokens) at most")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--settle-s", type=float, default=None, help=f"warm-up per timing (default {SETTLE_S})")
    ap.add_argument("--max-candidates", type=int, default=None, help="per GEMM and tile height (smoke tests)")
    ap.add_argument("--out", default=None, help="JSON to write (merged into if it is an earlier table)")
    ap.add_argument("--trace", type=Path, default=None, help="JSON lines: every candidate's time (appended)")
    ap.add_argument(
        "--seed", action="append", default=[], type=parse_tile, metavar="BM,BN,BK[,GM,W,S]",
        help="a tile tried first for both GEMMs (repeatable; a gated GEMM1's BN counts one half's columns)",
    )  # fmt: skip
    ap.add_argument(
        "--seed-config", action="append", default=[], type=Path, metavar="JSON",
        help="a vLLM / SGLang fused-MoE config file (and its SGLang '_down' twin beside it, for GEMM2): "
        "its tiles for each token count are tried first",
    )  # fmt: skip
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    console = make_console(stderr=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = Path(args.out or f"triton_fused_moe.{device_slug(name)}.json")
    why = outputs_problem(out, args.trace)
    if why is not None:
        console.print(f"[red]tune_fused_moe:[/red] {escape(why)}")
        return 2
    if dev.type == "cpu":
        from moehal.kernels.host import interpreting

        if not interpreting():
            console.print("[red]no GPU: the kernels run on the CPU only under TRITON_INTERPRET=1 (a smoke test)")
            return 2
    settle = SETTLE_S if args.settle_s is None else args.settle_s
    with Progress(console=console, transient=True) as progress:
        table = tune(
            args.shapes.split(","), [int(t) for t in args.tokens.split(",")], args.quant, dev,
            args.budget_s, args.reps, settle, args.max_candidates, progress,
            args.seed, [EngineConfig.load(p) for p in args.seed_config], args.trace,
        )  # fmt: skip
    merged = _table_or_none(out) if out.exists() else {}
    if merged is None:  # changed during the run: the new table goes beside it, not over it
        fd, kept = tempfile.mkstemp(dir=out.parent, prefix=f"{out.stem}.", suffix=".json")
        os.close(fd)
        console.print(f"[red]tune_fused_moe:[/red] {escape(str(out))} is no longer a tuned table: not overwritten")
        out, merged = Path(kept), {}
    for key, rows in table.items():
        merged.setdefault(key, {}).update(rows)
    merged["_meta"] = _meta(dev, settle)
    text = json.dumps(merged, indent=1, sort_keys=True) + "\n"
    replace_file(out, lambda part: part.write_text(text))  # an interrupted write leaves the old table
    for key, rows in table.items():
        for t, r in sorted(rows.items(), key=lambda kv: int(kv[0])):
            gain = r["heuristic_us"] / r["us"] if r["us"] > 0 else math.nan
            console.print(
                f"{key} T={t}: {r['us']:.1f} us (heuristic {r['heuristic_us']:.1f} us, {gain:.2f}x), "
                f"{r['tried']} tried, rejected: {r['rejected'] or 'none'}"
            )
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
