"""Markdown tables from `moehal bench --out` JSON files: per shape and token count, each
backend's time and % of roofline, ours against the SGLang peer, and fp8_block against bf16;
and the SM clock each row held, where the run sampled it. A run of several rounds
(`moehal bench --rounds`) shows each row's median time over the rounds with its % of roofline
(`_median_row`: for an even number of rounds, not quite the goals' median of %s), and each
ratio's median over the rounds of rows measured next to each other (the pairing `moehal goals`
uses).

    python tools/bench_compare.py docs/device-runs/.../bench.json [more.json ...]
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict

from moehal.bench_goals import read_bench_json
from moehal.errors import InputError


def _mhz(r: dict | None) -> str:
    x = r.get("sm_mhz") if r else None  # NaN in older files, null (no clock read) since session 57
    return f"{x:.0f}" if x is not None and math.isfinite(x) else "-"


def _median_row(rows: list[dict]) -> dict:
    """A row with the median time over the rounds (the mean of the two middle times for an even
    count) and the % of roofline of that time (roofline / median time). `moehal goals` and the
    plot take the median of the rounds' % values instead: the same for an odd count, and for an
    even count the mean of the two middle %s, which can differ from this by a fraction of a
    point. The other columns (clocks) are the lower middle round's."""
    ranked = sorted(rows, key=lambda r: r["time_us"])
    t = statistics.median(r["time_us"] for r in ranked)
    mid = dict(ranked[(len(ranked) - 1) // 2])
    mid["pct_roofline"] = mid["pct_roofline"] * mid["time_us"] / t  # same roofline, median time
    mid["time_us"] = t
    return mid


def _ratio(num: dict[int, dict], den: dict[int, dict]) -> str:
    """Median over the rounds that hold both rows of num's time over den's."""
    pairs = [num[k]["time_us"] / den[k]["time_us"] for k in num.keys() & den.keys()]
    return f"{statistics.median(pairs):.2f}x" if pairs else "-"


def table(path: str) -> str:
    data = read_bench_json(path)  # (an unknown schema: InputError)
    t: dict[tuple, dict[tuple, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in data["rows"]:
        t[(r["shape"], r["tokens"])][(r["backend"], r["quant"])][int(r.get("round") or 0)] = r
    rounds = int(data.get("rounds") or 1)
    lines = [
        f"`{path}`: {data['ceilings'].get('device', '?')}, {data['date']}, layers built for "
        f"{data.get('layer_max_tokens', 'each row')}" + (f", {rounds} rounds (medians)" if rounds > 1 else ""),
        "",
        "| shape | tokens | bf16 us (% roofline) | SGLang bf16 us (%) | vs SGLang | fp8_block us (%) | fp8 vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    clocks = any(r.get("sm_mhz") is not None and math.isfinite(r["sm_mhz"]) for r in data["rows"])
    if clocks:  # runs that sampled clocks (moehal.clock_sampler): the SM clock each row held
        lines[-2] += " bf16 / SGLang / fp8 SM MHz |"
        lines[-1] += "---|"
    for (shape, tokens), cells in sorted(t.items()):
        ours, peer, fp8 = (
            cells.get(("cuda", "bf16"), {}),
            cells.get(("sglang", "bf16"), {}),
            cells.get(("cuda", "fp8_block"), {}),
        )
        mid = {k: _median_row(list(v.values())) if v else None for k, v in (("o", ours), ("p", peer), ("f", fp8))}

        def cell(r: dict | None) -> str:
            return f"{r['time_us']:.1f} ({r['pct_roofline']:.0f}%)" if r else "-"

        line = (
            f"| {shape} | {tokens} | {cell(mid['o'])} | {cell(mid['p'])} | {_ratio(peer, ours)} | {cell(mid['f'])} "
            f"| {_ratio(ours, fp8)} |"
        )
        if clocks:
            line += " " + " / ".join(_mhz(r) for r in mid.values()) + " |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        print("\n\n".join(table(p) for p in sys.argv[1:]))
    except InputError as exc:  # a file of a schema this tool does not read: one line, no traceback
        raise SystemExit(f"bench_compare.py: {exc}") from None
