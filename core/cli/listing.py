"""`moehal list`: every declared implementation with its declarations."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import moehal
from moehal.cli.common import cell, console, print_json, table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list every dispatcher, experts kernel, fused forward and weight processor")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: Sequence[str] = ()) -> int:
    reg = moehal.discover()
    rows = []
    for kind, impls in (
        ("dispatcher", reg.dispatchers),
        ("experts", reg.experts),
        ("fused", reg.fused),
        ("weights", reg.processors),
    ):
        for i in sorted(impls, key=lambda i: (-i.priority, i.qualname)):
            rows.append(
                {
                    "name": i.qualname,
                    "kind": kind,
                    "priority": i.priority,
                    "devices": sorted(i.devices),
                    "quant": sorted(q.name for q in i.quant_schemes),
                    "graph_capturable": i.graph_capturable,
                    "description": i.description,
                }
            )
    if args.json:
        print_json(rows)
        return 0
    t = table("Implementations", "name", "kind", "prio", "devices", "quant schemes", "graphs", "description")
    for r in rows:
        t.add_row(
            r["name"],
            r["kind"],
            str(r["priority"]),
            ",".join(r["devices"]),
            # no schemes declared: dispatchers and weight processors take any; experts kernels and
            # fused forwards take none (`Implementation.check_quant` declines every scheme)
            ",".join(r["quant"]) or ("any" if r["kind"] in ("dispatcher", "weights") else "none"),
            "yes" if r["graph_capturable"] else "no",
            cell(r["description"]),
        )
    console.print(t)
    return 0
