"""Markdown tables from `moehal bench --out` JSON files: per shape and token count, each
backend's time and % of roofline, ours against the SGLang peer, and fp8_block against bf16;
and the SM clock each row held, where the run sampled it.

    python tools/bench_compare.py docs/device-runs/.../bench.json [more.json ...]
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def _mhz(r: dict | None) -> str:
    x = r.get("sm_mhz", math.nan) if r else math.nan
    return f"{x:.0f}" if math.isfinite(x) else "-"


def table(path: str) -> str:
    data = json.loads(open(path).read())
    t: dict[tuple, dict] = defaultdict(dict)
    for r in data["rows"]:
        t[(r["shape"], r["tokens"])][(r["backend"], r["quant"])] = r
    lines = [
        f"`{path}`: {data['ceilings'].get('device', '?')}, {data['date']}, layers built for "
        f"{data.get('layer_max_tokens', 'each row')}",
        "",
        "| shape | tokens | bf16 us (% roofline) | SGLang bf16 us (%) | vs SGLang | fp8_block us (%) | fp8 vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    clocks = any(math.isfinite(r.get("sm_mhz", math.nan)) for r in data["rows"])
    if clocks:  # runs that sampled clocks (moehal.clock_sampler): the SM clock each row held
        lines[-2] += " bf16 / SGLang / fp8 SM MHz |"
        lines[-1] += "---|"
    for (shape, tokens), rows in sorted(t.items()):
        ours, peer, fp8 = rows.get(("cuda", "bf16")), rows.get(("sglang", "bf16")), rows.get(("cuda", "fp8_block"))

        def cell(r: dict | None) -> str:
            return f"{r['time_us']:.1f} ({r['pct_roofline']:.0f}%)" if r else "-"

        vs = f"{peer['time_us'] / ours['time_us']:.2f}x" if ours and peer else "-"
        f8 = f"{ours['time_us'] / fp8['time_us']:.2f}x" if ours and fp8 else "-"
        line = f"| {shape} | {tokens} | {cell(ours)} | {cell(peer)} | {vs} | {cell(fp8)} | {f8} |"
        if clocks:
            line += " " + " / ".join(_mhz(r) for r in (ours, peer, fp8)) + " |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
