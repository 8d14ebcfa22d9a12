"""Measure DeepGEMM's masked grouped GEMM against the Triton one, per GEMM shape and token
count, and write the table `moehal_cuda.gemm_choice` reads.

    python -m moehal_cuda.tuning --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \\
        --tokens 1,4,16,32,64,128,256,512,1024,2048,4096 --quant bf16 --out tuned.json

For each MoE shape (see `moehal.bench.SHAPES`) both GEMMs of the experts are tuned: w13
(N = 2I, K = H) and w2 (N = H, K = I). For each token count T, the masked rows per expert come
from uniform random top-k routing of T tokens; each timing cycles over 8 different routings so
that a decode step's few experts are not served from L2 by the previous replay. Every
candidate tile runs once under a CUDA graph of those 8 launches (median of several replays,
CUDA events), after half a second of the same replays: the clocks an H100 holds at its power
cap under prefill-sized GEMMs, 1100-1500 MHz, not the 1980 MHz of a GPU that just woke up
(a tile that wins at boost clocks can lose under the cap; tables before session 9 were timed
without this); DeepGEMM runs the same way on the same inputs. The faster one is written down
with both times, so the table shows the margin it was chosen by.

Candidate tiles are compiled first, in parallel worker processes that only fill Triton's
on-disk cache (compiling ~50 tiles per GEMM one after another would take minutes); the
timing itself runs in this process alone, one kernel at a time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import math
import multiprocessing as mp
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from moehal.graphs import capturing
from moehal.kernels.tiles import TileConfig
from moehal_cuda.gemm_choice import device_slug, entry_key

ROTATIONS = 8  # different routings per timed graph (see module doc)
MASKED_ALIGN = 64


# --- candidates ------------------------------------------------------------------------------------


def candidate_configs(rows_per_expert: float, n: int, k: int, fp8: bool) -> list[TileConfig]:
    """Tiles worth trying for an average of `rows_per_expert` rows per active expert."""
    bks = (64, 128) if fp8 else (64, 128, 256)
    out: list[TileConfig] = []
    if rows_per_expert <= 24:  # decode: stream the weights, short M tiles
        for bn in (32, 64, 128):
            for bk in bks:
                for stages in (3, 4, 5):
                    out.append(TileConfig(16, bn, bk, 1, 4, stages))
    if 8 <= rows_per_expert <= 128:
        for bm in (32, 64):
            for bn in (64, 128):
                for bk in (64, 128):
                    for warps, stages in ((4, 3), (4, 4), (8, 3)):
                        out.append(TileConfig(bm, bn, bk, 8 if bm == 64 else 1, warps, stages))
    if rows_per_expert >= 64:  # prefill: big tiles, grouped order for L2 reuse
        for bm in (64, 128):
            for bn in (128, 256):
                for warps, stages in ((4, 3), (8, 3), (8, 4)):
                    out.append(TileConfig(bm, bn, 64, 8, warps, stages))
    return [c for c in dict.fromkeys(out) if c.fits(n, k, fp8)]


def routing_counts(tokens: int, experts: int, top_k: int, rotations: int, seed: int = 0) -> list[torch.Tensor]:
    """masked_m for `rotations` random uniform top-k routings of `tokens` tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rotations):
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
        out.append(torch.bincount(ids.flatten(), minlength=experts).to(torch.int32))
    return out


# --- problems --------------------------------------------------------------------------------------


class Problem:
    """One GEMM of one MoE shape, with its operands on the GPU (sized for the largest T)."""

    def __init__(
        self, e: int, n: int, k: int, max_tokens: int, fp8: bool, dev: torch.device, fill: bool = True
    ) -> None:
        self.e, self.n, self.k, self.fp8 = e, n, k, fp8
        self.max_m = -(-max_tokens // MASKED_ALIGN) * MASKED_ALIGN
        if fill:
            g = torch.Generator(device=dev).manual_seed(1)
            w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(k)
            a = torch.randn(e, self.max_m, k, device=dev, dtype=torch.bfloat16, generator=g)
        else:  # compile-only: same shapes and strides, no values
            w = torch.empty(e, n, k, device=dev, dtype=torch.bfloat16)
            a = torch.empty(e, self.max_m, k, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty(e, self.max_m, n, device=dev, dtype=torch.bfloat16)
        if fp8:
            self.w = w.to(torch.float8_e4m3fn)
            self.w_scale = torch.rand(e, -(-n // 128), -(-k // 128), device=dev) + 0.5
            self.a = a.to(torch.float8_e4m3fn)
            g128 = -(-k // 128)
            raw = torch.rand(e, g128, -(-self.max_m // 4) * 4, device=dev) + 0.5  # MN-major, as dispatched
            self.a_scale = raw.transpose(1, 2)[:, : self.max_m, :]
        else:
            self.w, self.a = w, a
            self.w_scale = self.a_scale = None

    def triton(self, cfg: TileConfig, masked_m: torch.Tensor, total_rows: int) -> None:
        from moehal.kernels.triton_grouped_gemm import masked_grouped_gemm

        masked_grouped_gemm(self.a, self.a_scale, self.w, self.w_scale, self.out, masked_m, total_rows, cfg)

    def deepgemm(self, ops: Any, masked_m: torch.Tensor, expected_m: int) -> None:
        ops.masked(self.a, self.a_scale, self.w, self.w_scale, self.out, masked_m, expected_m)


def _compile_worker(args: tuple[int, int, int, bool, list[dict[str, int]]]) -> list[tuple[dict[str, int], str]]:
    """Run each tile once on an empty problem (all masked_m zero): fills Triton's disk cache."""
    e, n, k, fp8, cfgs = args
    dev = torch.device("cuda")
    prob = Problem(e, n, k, MASKED_ALIGN, fp8, dev, fill=False)
    zero = torch.zeros(e, dtype=torch.int32, device=dev)
    failed = []
    for d in cfgs:
        try:
            prob.triton(TileConfig.from_dict(d), zero, 1)
            torch.cuda.synchronize()
        except Exception as exc:  # out of shared memory, bad layout: the tile is dropped
            failed.append((d, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
    return failed


def precompile(jobs: Sequence[tuple[int, int, int, bool, list[TileConfig]]], workers: int) -> set[tuple]:
    """Compile all tiles in `workers` processes; returns the (e, n, k, fp8, config) that failed."""
    tasks = []
    for e, n, k, fp8, cfgs in jobs:
        per = 4  # small tasks: workers stay busy until the end
        for i in range(0, len(cfgs), per):
            tasks.append((e, n, k, fp8, [c.as_dict() for c in cfgs[i : i + per]]))
    failed: set[tuple] = set()
    if workers <= 1:
        results = [(t, _compile_worker(t)) for t in tasks]
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            results = list(zip(tasks, pool.map(_compile_worker, tasks, chunksize=1)))
    for (e, n, k, fp8, _), fails in results:
        for d, _why in fails:
            failed.add((e, n, k, fp8, TileConfig.from_dict(d)))
    return failed


def time_graph(launches: Sequence[Callable[[], None]], reps: int = 5) -> float:
    """Median microseconds per launch of a CUDA graph replaying `launches` once each, timed after
    `moehal.bench.SETTLE_S` of back-to-back replays: at the clocks the GPU holds under this
    kernel, not the boost clocks of its first tens of milliseconds."""
    from moehal.bench import settle

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in launches:  # warm-up (and JIT) outside the capture
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):  # (why: moehal.graphs.capturing)
        for f in launches:
            f()
    graph.replay()
    torch.cuda.synchronize()
    settle(graph.replay, torch.device("cuda"), batch=4)
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1000.0 / len(launches))
    del graph
    return statistics.median(times)


# --- the tuning loop -------------------------------------------------------------------------------


def tune(
    shapes: Iterable[str],
    tokens: Sequence[int],
    quants: Sequence[str],
    out_path: str,
    workers: int,
    budget_s: float,
    log: Callable[[str], None] = print,
    update: bool = False,
) -> dict[str, Any]:
    from moehal.bench import SHAPES
    from moehal_cuda.deepgemm_experts import DeepGemmOps

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    t_start = time.monotonic()
    table: dict[str, Any] = {"meta": _meta(name), "entries": {}}
    if update and os.path.exists(out_path):  # keep what an earlier run measured (e.g. bf16 beside fp8)
        with open(out_path) as f:
            old = json.load(f)
        table["entries"].update(old.get("entries", {}))
        table["meta"]["earlier_runs"] = [*old.get("meta", {}).get("earlier_runs", []), old.get("meta", {})]
    problems = []
    for shape in shapes:
        s = SHAPES[shape]
        e, h, i, top_k = s["num_experts"], s["hidden_size"], s["intermediate_size"], s["top_k"]
        for q in quants:
            for n, k in ((2 * i, h), (h, i)):
                problems.append((shape, e, n, k, top_k, q == "fp8_block"))
    jobs = []
    for _shape, e, n, k, top_k, fp8 in problems:
        cands = {c for t in tokens for c in candidate_configs(t * top_k / e, n, k, fp8)}
        jobs.append((e, n, k, fp8, sorted(cands, key=lambda c: tuple(c.as_dict().values()))))
    t0 = time.monotonic()
    failed = precompile(jobs, workers)
    ntiles = sum(len(j[4]) for j in jobs)
    log(f"compiled {ntiles} tiles in {time.monotonic() - t0:.0f}s ({len(failed)} do not fit this GPU)")
    ops = {fp8: DeepGemmOps(fp8, False, replay_graphs=False) for fp8 in {p[-1] for p in problems}}
    for shape, e, n, k, top_k, fp8 in problems:
        key = entry_key(e, n, k, "fp8_block" if fp8 else "bf16")
        prob = Problem(e, n, k, max(tokens), fp8, dev)
        # --update re-tunes only the token counts asked for: a shape's other rows stay
        entry: dict[str, Any] = dict(table["entries"].get(key, {})) if update else {}
        for t in tokens:
            if time.monotonic() - t_start > budget_s:
                log(f"time budget reached: {key} stops before T={t}")
                break
            counts = [c.to(dev) for c in routing_counts(t, e, top_k, ROTATIONS, seed=t)]
            total = t * top_k
            expected = max(1, -(-total // e))
            dg_us = time_graph([functools.partial(prob.deepgemm, ops[fp8], c, expected) for c in counts])
            best: tuple[float, TileConfig] | None = None
            for cfg in candidate_configs(total / e, n, k, fp8):
                if (e, n, k, fp8, cfg) in failed:
                    continue
                try:
                    us = time_graph([functools.partial(prob.triton, cfg, c, total) for c in counts])
                except Exception as exc:  # a tile that compiled but cannot launch here
                    log(f"  {key} T={t} {cfg}: {type(exc).__name__}")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            row: dict[str, Any] = {"use": "deepgemm", "us": {"deepgemm": round(dg_us, 2)}}
            if best is not None:
                row["us"]["triton"] = round(best[0], 2)
                row["config"] = best[1].as_dict()
                if best[0] < dg_us:
                    row["use"] = "triton"
            entry[str(t)] = row
            log(
                f"{shape:16s} {key:34s} T={t:5d}  deepgemm {dg_us:8.1f} us  "
                f"triton {row['us'].get('triton', float('nan')):8.1f} us  -> {row['use']}"
            )
        table["entries"][key] = by_tokens(entry)
        del prob
        torch.cuda.empty_cache()
        _write(table, out_path)
    return table


# --- the fused GEMM1 + activation tile (decode) ------------------------------------------------------


def fused_candidates(n13: int, k: int) -> list[TileConfig]:
    """Tiles for the fused GEMM1 + activation at decode sizes. Its N tile spans a gate and an up
    block, so it holds two B tiles per stage; only tiles that fit shared memory are tried."""
    from moehal.kernels.triton_grouped_gemm import SMEM_BUDGET, smem_bytes

    i = n13 // 2
    out = []
    for bn in (16, 32, 64):
        for bk in (64, 128, 256):
            for warps in (2, 4):
                for stages in (3, 4, 5, 6):
                    c = TileConfig(16, bn, bk, 1, warps, stages)
                    if c.fits(i, k, False) and smem_bytes(c, 2, b_tiles=2) <= SMEM_BUDGET:
                        out.append(c)
    return out


class FusedProblem:
    """The fused GEMM1 + activation of one MoE shape (bf16, SiLU), operands on the GPU."""

    def __init__(self, e: int, n13: int, k: int, h: int, max_tokens: int, dev: torch.device, fill: bool = True) -> None:
        g = torch.Generator(device=dev).manual_seed(2)
        self.max_m = -(-max_tokens // MASKED_ALIGN) * MASKED_ALIGN
        if fill:
            self.a = torch.randn(e, self.max_m, k, device=dev, dtype=torch.bfloat16, generator=g)
            self.w = torch.randn(e, n13, k, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(k)
        else:  # compile-only: same shapes and strides, no values
            self.a = torch.empty(e, self.max_m, k, device=dev, dtype=torch.bfloat16)
            self.w = torch.empty(e, n13, k, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty(e, self.max_m, n13 // 2, device=dev, dtype=torch.bfloat16)
        self.y = torch.zeros(e, self.max_m, h, device=dev, dtype=torch.bfloat16)
        self.rows = torch.zeros(2, e, device=dev, dtype=torch.int32)

    def run(self, cfg: TileConfig, masked_m: torch.Tensor, total_rows: int) -> None:
        from moehal.kernels.triton_fused_moe import _ACTS
        from moehal.kernels.triton_grouped_gemm import masked_gemm_act

        a, w, out, rows, y = self.a, self.w, self.out, self.rows, self.y
        masked_gemm_act(a, w, None, out, rows, y, masked_m, total_rows, cfg, activation=_ACTS["silu"], gated=True)


def _compile_fused_worker(args: tuple[int, int, int, int, list[dict[str, int]]]) -> list[str]:
    """Run each fused tile once with no routed rows (fills Triton's disk cache); returns the
    `_fused_key`s of the tiles that failed."""
    e, n13, k, h, cfgs = args
    prob = FusedProblem(e, n13, k, h, MASKED_ALIGN, torch.device("cuda"), fill=False)
    zero = torch.zeros(e, dtype=torch.int32, device="cuda")
    failed = []
    for d in cfgs:
        try:
            prob.run(TileConfig.from_dict(d), zero, 1)
            torch.cuda.synchronize()
        except Exception:  # out of shared memory or registers: the tile is dropped
            failed.append(_fused_key(e, n13, k, d))
    return failed


def _fused_key(e: int, n13: int, k: int, cfg: dict[str, int]) -> str:
    return f"{e},{n13},{k}:" + json.dumps(cfg, sort_keys=True)


def tune_fused(
    shapes: Iterable[str],
    tokens: Sequence[int],
    out_path: str,
    budget_s: float,
    workers: int = 1,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Add the fused GEMM1 + activation's own tile to a bf16 table's GEMM1 rows where the
    experts fuse (Triton GEMM1, <= FUSE_MAX_ROWS_PER_EXPERT rows per expert): the tile tuned for
    the plain GEMM1 is adapted by `fused_act_config`, which keeps its N tile although the fused
    kernel's N tile covers a gate and an up block. Each row gets
    `"fused": {"config", "us", "adapted_us"}`, the best candidate beside the adapted tile."""
    from moehal.bench import SHAPES
    from moehal.kernels.triton_grouped_gemm import fused_act_config
    from moehal_cuda.deepgemm_experts import FUSE_MAX_ROWS_PER_EXPERT

    dev = torch.device("cuda")
    t_start = time.monotonic()
    with open(out_path) as f:
        table = json.load(f)
    plan: dict[str, list[int]] = {}  # shape -> the token counts whose GEMM1 the experts fuse
    for shape in shapes:
        s = SHAPES[shape]
        key = entry_key(s["num_experts"], 2 * s["intermediate_size"], s["hidden_size"], "bf16")
        entry = table["entries"].get(key, {})
        todo = [t for t in tokens if str(t) in entry and t * s["top_k"] <= FUSE_MAX_ROWS_PER_EXPERT * s["num_experts"]]
        plan[shape] = [t for t in todo if entry[str(t)].get("use") == "triton" and entry[str(t)].get("config")]
        if not plan[shape]:
            log(f"{shape}: no fused GEMM1 rows to tune ({key})")
    jobs = []
    for shape in (sh for sh, todo in plan.items() if todo):
        s = SHAPES[shape]
        e, h, i = s["num_experts"], s["hidden_size"], s["intermediate_size"]
        cfgs = [c.as_dict() for c in fused_candidates(2 * i, h)]
        jobs += [(e, 2 * i, h, h, cfgs[j : j + 4]) for j in range(0, len(cfgs), 4)]
    with mp.get_context("spawn").Pool(max(1, workers)) as pool:
        results = pool.map(_compile_fused_worker, jobs, chunksize=1)
    failed = {key for fails in results for key in fails}
    ntiles = sum(len(j[4]) for j in jobs)
    log(f"compiled {ntiles} fused tiles in {time.monotonic() - t_start:.0f}s ({len(failed)} failed)")
    for shape in (sh for sh, todo in plan.items() if todo):
        s = SHAPES[shape]
        e, h, i, top_k = s["num_experts"], s["hidden_size"], s["intermediate_size"], s["top_k"]
        key = entry_key(e, 2 * i, h, "bf16")
        entry, todo = table["entries"][key], plan[shape]
        prob = FusedProblem(e, 2 * i, h, h, max(todo), dev)
        for t in todo:
            if time.monotonic() - t_start > budget_s:
                log(f"time budget reached: {key} stops before T={t}")
                break
            row = entry[str(t)]
            counts = [c.to(dev) for c in routing_counts(t, e, top_k, ROTATIONS, seed=t)]
            total = t * top_k
            adapted = fused_act_config(TileConfig.from_dict(row["config"]), h)

            def timed(cfg: TileConfig, prob: FusedProblem = prob, counts: list = counts, total: int = total) -> float:
                return time_graph([functools.partial(prob.run, cfg, c, total) for c in counts])

            adapted_us = timed(adapted)
            best = (adapted_us, adapted)
            for cfg in fused_candidates(2 * i, h):
                if _fused_key(e, 2 * i, h, cfg.as_dict()) in failed:
                    continue
                try:
                    us = timed(cfg)
                except Exception as exc:  # a tile that cannot launch here
                    log(f"  {key} T={t} {cfg}: {type(exc).__name__}")
                    continue
                if us < best[0]:
                    best = (us, cfg)
            row["fused"] = {"config": best[1].as_dict(), "us": round(best[0], 2), "adapted_us": round(adapted_us, 2)}
            log(f"{shape:16s} {key:34s} T={t:5d}  fused: adapted {adapted_us:7.1f} us, best {best[0]:7.1f} {best[1]}")
        del prob
        torch.cuda.empty_cache()
        table.setdefault("meta", {})["fused_tuned"] = _meta(torch.cuda.get_device_name(dev))
        _write(table, out_path)
    return table


def _meta(device_name: str) -> dict[str, Any]:
    import triton

    try:
        from importlib.metadata import version

        dg = version("sgl-deep-gemm")
    except Exception:
        dg = None
    return {
        "device": device_name,
        "slug": device_slug(device_name),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "deep_gemm": dg,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "method": "median of 5 CUDA-graph replays x 8 routings, per launch, after 0.5 s of replays (settled clocks)",
    }


def by_tokens(entry: dict[str, Any]) -> dict[str, Any]:
    """A shape's rows in ascending token count (JSON keys are strings: "16" sorts before "4")."""
    return {t: entry[t] for t in sorted(entry, key=int)}


def _write(table: dict[str, Any], path: str) -> None:
    """`path` replaced in one step (`moehal.cli.common.replace_file`): an interrupted write
    leaves the previous table."""
    from moehal.cli.common import replace_file

    text = json.dumps(table, indent=1, sort_keys=False)
    replace_file(pathlib.Path(path), lambda part: part.write_text(text))


def _is_table(path: pathlib.Path) -> bool:
    """Whether the existing file `path` is a table this tool wrote (`gemm_choice.register_table`'s
    test: a JSON object with an `entries` object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        return False
    return isinstance(data, dict) and isinstance(data.get("entries"), dict)


def out_problem(out: str, fused_only: bool = False) -> str | None:
    """Why `--out` could not be written, found before the tuning run whose table would then be
    lost; None where it can. A file already there is replaced (or, with --update or
    --fused-only, added to) only where it is an earlier table: `--out` once replaced whatever it
    named. --fused-only needs one. Makes nothing: the folder is made when the table is written."""
    from moehal.cli.common import output_problem

    path = pathlib.Path(out)
    why = output_problem([path], _is_table, "a moehal_cuda.tuning table")
    if why is None and fused_only and not path.is_file():
        why = f"{out}: --fused-only adds to an existing table, and there is none"
    return why


def main(argv: Sequence[str] | None = None) -> int:
    from moehal.bench import SHAPES

    ap = argparse.ArgumentParser(prog="python -m moehal_cuda.tuning", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    ap.add_argument("--tokens", default="1,4,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--quant", default="bf16", help="bf16,fp8_block")
    ap.add_argument(
        "--out", required=True, help="JSON path (written after every GEMM shape; an existing file must be a table)"
    )
    ap.add_argument(
        "--update", action="store_true", help="keep what --out holds; only the token counts tuned now are replaced"
    )
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop timing after this many seconds")
    ap.add_argument(
        "--fused-only", action="store_true", help="only tune the fused GEMM1 + activation tile of --out's bf16 rows"
    )
    args = ap.parse_args(argv)
    why = out_problem(args.out, args.fused_only)
    if why is not None:
        print(f"moehal_cuda.tuning: {why}")
        return 2
    if not torch.cuda.is_available():
        print("moehal_cuda.tuning needs a CUDA GPU (it measures kernels); none is visible")
        return 2
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.fused_only:
        tune_fused(shapes, tokens, args.out, args.budget_s, args.workers)
        print(f"wrote {args.out}")
        return 0
    tune(shapes, tokens, args.quant.split(","), args.out, args.workers, args.budget_s, update=args.update)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
