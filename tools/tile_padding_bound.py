"""Markdown table: each prefill row of `moehal bench --out` JSON files beside the ceilings that
whole row tiles put under its roofline (`moehal.tile_bounds`), and what #4's prefill goals
(75% of roofline; 1.2x the SGLang peer) would ask of the GEMMs.

Runs anywhere (CPU): it re-draws the benchmark's routing for each row (`moehal.bench.bench_inputs`)
and takes the ceilings the run measured from its JSON. A run of several rounds (`moehal bench
--rounds`) is read as `moehal goals` reads it: "measured" is the median of the rounds' % of
roofline, and a time the median of the rounds' times (`medians`).

    python tools/tile_padding_bound.py docs/device-runs/.../record-bench.json [more.json ...] [--plot out.png]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable, Sequence

import moehal
import torch
from moehal.bench import SHAPES, bench_inputs
from moehal.bench_goals import ISSUE_4_GOALS, format_value, read_bench_json
from moehal.errors import InputError
from moehal.tile_bounds import tile_bound

PREFILL_GOAL = next(g for g in ISSUE_4_GOALS if g.name == "prefill_roofline")
GOAL_PCT = PREFILL_GOAL.target  # 75% of roofline, at 1024-4096 tokens
GOAL_VS_PEER = next(g for g in ISSUE_4_GOALS if g.name == "prefill_vs_peer").target  # x SGLang's tuned Triton path


def medians(rows: Sequence[dict]) -> dict[tuple, dict]:
    """Rows per (shape, tokens, backend, quant), one per cell: the median of its rounds'
    `pct_roofline` and of their `time_us` (as `moehal goals` takes a cell's value), with
    `rounds` how many there were (rows whose output was wrong left out). Before session 59 this
    tool kept the last round alone."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("check") == "fail":  # a wrong output's time is no measurement (as in the goals)
            continue
        cells.setdefault((r["shape"], r["tokens"], r["backend"], r["quant"]), []).append(r)
    return {
        k: {**rs[0], "pct_roofline": _median(r.get("pct_roofline") for r in rs),
            "time_us": statistics.median(r["time_us"] for r in rs), "rounds": len(rs)}
        for k, rs in cells.items()
    }  # fmt: skip


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the values given, None where there is none: an int8 row without an int8
    ceiling (`moehal.bench.NO_INT8_CEILING`) has no `pct_roofline`."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _rate(x: float) -> str:
    return "impossible (glue alone)" if x == float("inf") else f"{100 * x:.0f}%"


def table(path: str, min_tokens: int = 512) -> str:
    data = read_bench_json(path)  # (an unknown schema: InputError)
    ceil = data["ceilings"]
    rows = medians(data["rows"])
    rounds = max((r["rounds"] for r in rows.values()), default=1)
    keys = sorted({(s, t) for s, t, b, q in rows if b == "cuda" and q == "bf16" and t >= min_tokens and s in SHAPES})
    out = [
        f"`{path}`: {ceil.get('device', '?')}, {data['date']}; ceilings {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (bf16)"
        + (f"; measured: medians of {rounds} rounds" if rounds > 1 else ""),
        "",
        "| shape | tokens | rows per expert (mean / max) | 128-row tile efficiency | ceiling: 128-row tiles "
        "| + glue | + glue, no permute copy | 64-row tiles + glue | measured | GEMMs ran at >= | 75% needs GEMMs at "
        "| 1.2x SGLang = | which needs GEMMs at |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, tokens in keys:
        cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=tokens)
        _, ids, _ = bench_inputs(cfg, tokens)
        counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
        b = tile_bound(cfg, counts, ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"], block_m=128)
        b64 = tile_bound(cfg, counts, ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"], block_m=64)
        ours, peer = rows[(shape, tokens, "cuda", "bf16")], rows.get((shape, tokens, "sglang", "bf16"))
        if abs(ours["roofline_us"] - b.roofline_us) > 1e-3 * b.roofline_us:  # another routing or formula
            raise SystemExit(f"{path}: {shape} {tokens}: roofline {ours['roofline_us']:.1f} != {b.roofline_us:.1f} us")
        measured = format_value(PREFILL_GOAL, ours["pct_roofline"])  # 74.6% never prints as 75%
        vs_peer = vs_peer_rate = "-"
        if peer is not None:
            pct = 100 * b.roofline_us / (peer["time_us"] / GOAL_VS_PEER)
            vs_peer, vs_peer_rate = f"{pct:.0f}%", _rate(b.gemm_rate_needed(pct))
        out.append(
            f"| {shape} | {tokens} | {b.mean_rows:.0f} / {b.max_rows} | {b.tile_efficiency:.2f} | {b.tiles_pct:.0f}% "
            f"| {b.pipeline_pct:.0f}% | {b.gathered_pct:.0f}% | {b64.pipeline_pct:.0f}% | {measured} "
            f"| {_rate(b.gemm_rate_at(ours['time_us']))} | {_rate(b.gemm_rate_needed(GOAL_PCT))} "
            f"| {vs_peer} | {vs_peer_rate} |"
        )
    return "\n".join(out)


def plot(path: str, png: str) -> None:
    """Per shape: % of roofline against tokens, measured (ours, SGLang) beside the ceilings of
    128- and 64-row tiles with the glue floor, and the 75% goal from 1024 tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_bench_json(path)  # (an unknown schema: InputError)
    ceil = data["ceilings"]
    rows = [r for r in data["rows"] if r["quant"] == "bf16" and r["shape"] in SHAPES]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        tokens = sorted({r["tokens"] for r in rows if r["shape"] == shape})
        for backend, style in (("cuda", "o-"), ("sglang", "s--")):
            mine = [r for r in rows if (r["shape"], r["backend"]) == (shape, backend)]
            if not mine:
                continue
            # the median of each token count's rounds, joined; every round a small marker
            mid = sorted((r["tokens"], r["pct_roofline"]) for r in medians(mine).values())
            who = "moehal" if backend == "cuda" else "SGLang"
            (line,) = ax.plot(*zip(*mid), style, label=f"measured: {who} bf16 (median)")
            ax.plot([r["tokens"] for r in mine], [r["pct_roofline"] for r in mine], ".", color=line.get_color())
        for block_m, style in ((128, "k-"), (64, "k:")):
            ceilings = []
            for t in tokens:
                cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=t)
                counts = torch.bincount(bench_inputs(cfg, t)[1].flatten(), minlength=cfg.num_experts)
                b = tile_bound(cfg, counts, ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"], block_m=block_m)
                ceilings.append(b.pipeline_pct)
            ax.plot(tokens, ceilings, style, lw=1, label=f"ceiling: {block_m}-row tiles + glue")
        ax.hlines(GOAL_PCT, 1024, max(tokens + [1024]), colors="tab:red", lw=1, label="goal from 1024 tokens")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(shape)
        ax.set_xlabel("tokens")
        ax.set_ylabel("% of roofline")
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{ceil.get('device', '?')}, {data['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", nargs="+")
    ap.add_argument("--min-tokens", type=int, default=512, help="rows from this token count up (default 512)")
    ap.add_argument("--plot", metavar="PNG", help="also plot the first JSON's rows and ceilings into PNG")
    args = ap.parse_args(argv)
    try:
        print("\n\n".join(table(p, args.min_tokens) for p in args.bench_json))
        if args.plot:
            plot(args.bench_json[0], args.plot)
    except InputError as exc:  # a file of a schema this tool does not read: one line, no traceback
        raise SystemExit(f"{ap.prog}: {exc}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
