"""`moehal` command line: doctor, explain, list, conformance, bench, goals."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Sequence

from moehal.cli import doctor, explain, goals, listing
from moehal.cli.common import print_json
from moehal.errors import MoEHalError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moehal", description="moehal: one MoE API, any hardware")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor.add_parser(sub)
    explain.add_parser(sub)
    listing.add_parser(sub)
    goals.add_parser(sub)
    conf = sub.add_parser("conformance", help="run the conformance suite against a backend", add_help=False)
    conf.set_defaults(func=_conformance)
    bench = sub.add_parser("bench", help="benchmark MoE layer forward", add_help=False)
    bench.set_defaults(func=_bench)
    return parser


def _conformance(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from moehal_conformance.cli import main as conformance_main

    return conformance_main(list(rest))


def _bench(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from moehal.bench import main as bench_main

    return bench_main(list(rest))


def _parse_explain_json(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | None:
    """`parser.parse_args(argv)` for `explain --json`, whose help promises one JSON object on
    stdout for every outcome: a usage error (`--experts x`) is `{"error": ..., "type":
    "UsageError"}` there, argparse's usage and message on stderr, and None (exit status 2)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help
            raise
        text = captured.getvalue()
        sys.stderr.write(text)
        message = text.strip().splitlines()[-1] if text.strip() else f"exit status {exc.code}"
        print_json({"error": message.split(" error: ", 1)[-1], "type": "UsageError"})
        return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # conformance and bench own their flags: everything after the subcommand goes to them.
    if argv and argv[0] in ("conformance", "bench"):
        args = argparse.Namespace(command=argv[0], func=_conformance if argv[0] == "conformance" else _bench)
        rest = argv[1:]
    elif argv[:1] == ["explain"] and any(len(a) >= 4 and "--json".startswith(a) for a in argv[1:]):
        # (argparse takes any unambiguous prefix of a flag: `--js` is --json too)
        parsed = _parse_explain_json(parser, argv)
        if parsed is None:
            return 2
        args, rest = parsed, []
    else:
        args, rest = parser.parse_args(argv), []
    try:
        return int(args.func(args, rest) or 0)
    except MoEHalError as exc:  # a bad MOEHAL_* variable, device or config, a plugin refused: its message
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        print(f"moehal {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
