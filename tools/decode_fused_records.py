"""Whole-layer FP8 decode records for the tuned tables (`"decode_fused"`, read by
`moehal_cuda.gemm_choice.GemmChooser.decode_fused`), from `tools/bench_ab.py` logs that ran
`fp8-unfused` beside `fp8-fused` and `fp8-fused=M/N/K/W/S` variants. Per layer shape and token
count: the unfused layer's time, and the fastest fused variant's time and tile (none: the plain
GEMM1 tile adapted). A shape's record is replaced as a whole, so one record never mixes runs.

    python tools/decode_fused_records.py LOG [LOG ...] --source docs/device-runs/.../fp8-fused-ab.log \
        [--into backends_cuda/tuned/masked_gemm.<slug>.json]   (without --into: print the records)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

_ROW = re.compile(r"^== (\S+) (fp8_block) T=(\d+)$")
_VARIANT = re.compile(r"^\s+(fp8-\S+)\s+([0-9.]+) us")


def parse(text: str) -> dict[tuple[str, int], dict[str, float]]:
    """(shape, tokens) -> {variant: median us} of a `tools/bench_ab.py` log's fp8_block rows."""
    rows: dict[tuple[str, int], dict[str, float]] = {}
    at: tuple[str, int] | None = None
    for line in text.splitlines():
        if m := _ROW.match(line):
            at = (m.group(1), int(m.group(3)))
            rows[at] = {}
        elif (m := _VARIANT.match(line)) and at is not None:
            rows[at][m.group(1)] = float(m.group(2))
    return rows


def records(rows: dict[tuple[str, int], dict[str, float]], source: str) -> dict[str, dict]:
    """`"decode_fused"` records keyed by each shape's fp8 GEMM1 entry key."""
    from moehal.bench import SHAPES
    from moehal.config import MoEConfig
    from moehal.kernels.tiles import TileConfig
    from moehal_cuda.gemm_choice import entry_key
    from moehal_cuda.tuning import by_tokens

    out: dict[str, dict] = {}
    for (shape, tokens), us in sorted(rows.items()):
        fused = {v: t for v, t in us.items() if v.startswith("fp8-fused")}
        if "fp8-unfused" not in us or not fused:
            continue
        best = min(fused, key=fused.__getitem__)
        cell: dict = {"current": us["fp8-unfused"], "fused": fused[best]}
        if "=" in best:
            m, n, k, w, s = (int(v) for v in best.split("=", 1)[1].split("/"))
            cell["config"] = TileConfig(m, n, k, 1, w, s).as_dict()
        cfg = MoEConfig(**SHAPES[shape])
        key = entry_key(cfg.num_local_experts, cfg.w13_rows, cfg.hidden_size, "fp8_block")
        rec = out.setdefault(key, {"source": source, "layer_us": {}})
        rec["layer_us"][str(tokens)] = cell
    for rec in out.values():
        rec["layer_us"] = by_tokens(rec["layer_us"])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("logs", nargs="+", type=pathlib.Path)
    p.add_argument("--source", required=True, help="where the measurements are kept (recorded with them)")
    p.add_argument("--into", type=pathlib.Path, help="the tuned table to write the records into")
    a = p.parse_args()
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for log in a.logs:
        rows.update(parse(log.read_text()))
    recs = records(rows, a.source)
    if a.into is None:
        print(json.dumps(recs, indent=1))
        return
    table = json.loads(a.into.read_text())
    table.setdefault("decode_fused", {}).update(recs)
    a.into.write_text(json.dumps(table, indent=1) + "\n")
    for key, rec in recs.items():
        print(f"{a.into.name}: decode_fused {key}: {rec['layer_us']}")


if __name__ == "__main__":
    main()
