"""Merge rows of a tuning table measured on a device into the table shipped for that device:
per GEMM shape, per token count, and likewise the `"prefill_fused"` records of
`tools/fused_prefill_probe.py --json` and the `"prefill_portable"` records of
`tools/portable_prefill_probe.py --json`, and the `"decode_fused"` records of
`tools/decode_fused_records.py` (`python -m moehal_cuda.tuning --update` does the same on the
device; this is for a table brought back from one).

    python tools/merge_tuned.py NEW.json [--into backends_cuda/tuned/masked_gemm.<slug>.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from moehal_cuda.tuning import by_tokens


def merge(shipped: dict, new: dict) -> list[str]:
    """Rows of `new` replace or extend `shipped`'s, shape by shape; returns what changed."""
    changed = []
    for key, rows in new.get("entries", {}).items():
        entry = shipped.setdefault("entries", {}).setdefault(key, {})
        for tokens, row in rows.items():
            if entry.get(tokens) != row:
                changed.append(f"{key} T={tokens}: {row.get('use')} {row.get('us')}")
                entry[tokens] = row
        shipped["entries"][key] = by_tokens(entry)
    # whole-layer records (tools/fused_prefill_probe.py): a shape's record is replaced as a whole,
    # so that one record never mixes counts measured by two methods or with two tiles
    # (tools/portable_prefill_probe.py: prefill_portable; tools/decode_fused_records.py: decode_fused)
    for kind in ("prefill_fused", "prefill_portable", "decode_fused"):
        for key, rec in new.get(kind, {}).items():
            pre = shipped.setdefault(kind, {})
            if pre.get(key) != rec:
                changed.append(f"{kind} {key}: {rec['layer_us']}")
                pre[key] = {**rec, "layer_us": by_tokens(rec["layer_us"])}
    if changed:
        meta = shipped.setdefault("meta", {})
        run = {k: v for k, v in new.get("meta", {}).items() if k != "earlier_runs"}
        meta["merged_runs"] = [*meta.get("merged_runs", []), run]
    return changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("--into", default=None)
    a = ap.parse_args()
    new = json.loads(pathlib.Path(a.new).read_text())
    into = pathlib.Path(a.into or f"backends_cuda/tuned/masked_gemm.{new['meta']['slug']}.json")
    shipped = json.loads(into.read_text())
    for line in merge(shipped, new):
        print(line)
    into.write_text(json.dumps(shipped, indent=1) + "\n")


if __name__ == "__main__":
    main()
