"""`moehal goals`: the performance goals (`moehal.bench_goals`) checked against saved
`moehal bench --out` JSON files; one device's files are merged (e.g. a bf16 and an fp8 run)."""

from __future__ import annotations

import argparse
import sys

from moehal.cli.common import make_console, print_json

EPILOG = """\
exit status:
  0  the goals' table (or --markdown, --json) was printed; without --check whether or not the
     goals are met (it reports: read a goal's status in the output), with --check every
     measured cell met its goal, informational goals aside (host_graphs, host_graphs_b2b: a
     graph replay's host time, not a goal of the issue). Cells not measured (no peer row, a skipped or wrong row, a
     peer that ran no tuned config) do not fail it, but their goal reads "partly measured",
     never "met", and --check names them on stderr
  1  no row of the files is covered by a goal; with --check, also a measured cell that did not
     meet its goal, or a row whose output was wrong (bench's check against the reference: bench
     itself exited 1 for it); the output is printed first, then those cells and rows on stderr
  2  a usage error, or a file that is not a readable `moehal bench --out` JSON file (or one of
     a schema other than moehal.bench/1)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "goals",
        help="check saved benchmark runs against the performance goals",
        description="check saved `moehal bench --out` runs against the performance goals (moehal.bench_goals)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", help="`moehal bench --out` JSON files")
    p.add_argument("--markdown", action="store_true", help="markdown: the summary, then every cell")
    p.add_argument("--json", action="store_true", help="machine-readable: every cell")
    p.add_argument(
        "--pair-across-files",
        action="store_true",
        help="pair a ratio's rows from two files of one device where a file lacks the partner "
        "(each such cell says so); by default a ratio pairs rows of one file, one run",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="gate (CI): exit 1 where a measured cell misses its goal (informational goals aside) or a row's "
        "output was wrong, after printing "
        "the output as without it; "
        "cells not measured (no peer row, a skipped or wrong row, an untuned peer) do not fail the check: their "
        "goals read 'partly measured', and the check names them on stderr",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: object = None) -> int:
    """The exit status (`EPILOG`): 0 whatever the goals' status, unless `args.check`, where a
    measured cell that misses its goal, or a row with a wrong output, makes it 1 (after the
    output is printed)."""
    from moehal.bench_goals import CHECK, check_runs, goals_markdown, goals_table, load_runs, summarize

    checks = check_runs(args.files, across_files=args.pair_across_files)
    if not checks:
        print("no row of these files is covered by a goal", file=sys.stderr)
        return 1
    if args.json:  # a cell's `goal_status`: its goal's on its device and backend (`GoalSummary.status`)
        goal_status = {(s.goal.name, s.device, s.backend): s.status for s in summarize(checks)}
        print_json([
            {"goal": c.goal.name, "device": c.device, "backend": c.backend, "shape": c.shape, "tokens": c.tokens,
             "value": c.value, "low": c.low, "high": c.high, "rounds": c.rounds, "status": c.status, "note": c.note,
             "goal_status": goal_status[c.goal.name, c.device, c.backend], "gating": not c.goal.informational}
            for c in checks
        ])  # fmt: skip
    elif args.markdown:
        print(goals_markdown(checks), end="")
    else:
        make_console().print(goals_table(checks))  # made now: the width COLUMNS says at this call
    if not args.check:
        return 0
    # on stderr: --json's stdout stays one JSON document. Informational goals do not gate.
    info = sum(c.goal.informational for c in checks)
    checks = [c for c in checks if not c.goal.informational]
    missed = [c for c in checks if c.met is False]
    unmeasured = [c for c in checks if c.met is None]
    measured = len(checks) - len(unmeasured)
    if info:
        print(f"moehal goals --check: {info} cells of informational goals not checked", file=sys.stderr)
    if missed:
        print(f"moehal goals --check: {len(missed)} of {measured} measured cells miss their goal:", file=sys.stderr)
        for c in missed:
            print(f"  {c.goal.name} {c.device} {c.backend} {c.shape} {c.tokens}: {c.value_text}", file=sys.stderr)
    if unmeasured:  # they pass the check, but the reader must see what was not checked
        print(f"moehal goals --check: {len(unmeasured)} of {len(checks)} cells not measured, so not checked:",
              file=sys.stderr)  # fmt: skip
        for s in summarize(checks):
            if s.unmeasured:
                print(f"  {s.goal.name} {s.device} {s.backend}: {s.status}, {s.cells_text}", file=sys.stderr)
    # a wrong row is no measurement, so no cell of it can miss: but a gate must not pass it
    wrong = [r for rows in load_runs(args.files).values() for r in rows if r.get(CHECK) == "fail"]
    if wrong:
        print(f"moehal goals --check: {len(wrong)} rows had a wrong output (checked against the reference):",
              file=sys.stderr)  # fmt: skip
        for r in wrong:
            print(f"  {r['backend']} {r['quant']} {r['shape']} {r['tokens']}", file=sys.stderr)
    return 1 if missed or wrong else 0
