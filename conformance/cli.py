"""`moehal conformance`: run the suite with a progress bar, print a summary, write reports."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

from moehal.cli.common import int_at_least, make_console
from moehal.errors import MoEHalError
from moehal_conformance import components, report
from moehal_conformance.cases import Case
from moehal_conformance.runner import FAIL, NOT_RUN, PASS, CaseResult
from moehal_conformance.suite import Suite, selected
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

# Exit statuses (docs/conformance.md lists them too)
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3
_EXIT_CODES = """exit status:
  0  PASS: every case that ran passed and the backend claimed at least one configuration
     (with -k: the subset ran and passed at least one case; the reports say it is a subset)
  1  FAIL: a case failed, the device's context was lost, or the suite could not compute its
     cases (a check of the backend raised); also NOTHING CLAIMED (the backend claims nothing
     on this machine) and NOTHING RAN (a -k subset that ran and passed nothing)
  2  usage error, nothing run: unknown backend, a device this machine lacks, bad flags, a
     --report path that cannot be written or holds a file that is not a conformance report;
     also a run that PASSED but whose reports then failed to write (a FAIL or INCOMPLETE run
     keeps its 1 or 3; the verdict is printed before the error)
  3  INCOMPLETE: interrupted (Ctrl-C, or SIGTERM from a time limit) with no failure among the
     cases that ran; --report keeps what ran and marks the rest not run"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moehal conformance",
        description="prove a backend right against the oracle",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", required=True, help="backend name, or 'best' for the best one on this machine")
    p.add_argument("--device", default=None, help="device to run on (default: the best torch sees)")
    p.add_argument("--report", default=None, help="write PATH.json and PATH.md")
    p.add_argument("--emulate", action="store_true", help="allow the backend's explicitly labelled emulated mode")
    p.add_argument("--quick", action="store_true", help="fewer shape cases (for slow interpreters)")
    p.add_argument(
        "-k",
        dest="select",
        default=None,
        type=_k_expression,
        help="only cases whose id contains this text; texts combine with and, or, not and parentheses, as "
        "pytest's -k ('shapes/ and not fp8')",
    )
    p.add_argument(
        "--ep",
        type=int_at_least(0),
        default=0,
        metavar="WORLD",
        help="also run the expert-parallel cases on WORLD local processes (gloo, CPU)",
    )
    p.add_argument(
        "--ep-dispatcher",
        default=None,
        help="EP dispatcher qualname to prove (default: the generic one, then each of the backend's own)",
    )
    p.add_argument(
        "--no-poison",
        dest="poison",
        action="store_false",
        help="leave fresh allocations as the allocator hands them (by default they hold NaN, or 1 in integers)",
    )
    p.add_argument("--show-passing", action="store_true", help="list every case, not only failures")
    return p


def _interrupt_on_sigterm() -> None:
    """`timeout` sends SIGTERM: turn it into KeyboardInterrupt so the report of what ran is kept."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# Where the output is no terminal, the live bar draws nothing: a plain line on stderr instead,
# every this many cases or seconds (a 132-case run printed nothing for 50 s)
PROGRESS_EVERY = 25
PROGRESS_SECONDS = 30.0
# ... and while one case runs longer than this, a line every this many seconds that names it (those
# lines came between cases only: a case of minutes, or a hung one, looked like a hung run)
HEARTBEAT_SECONDS = 30.0

_STDERR = threading.Lock()  # the progress lines and the heartbeat's thread: whole lines, one at a time


def _say(line: str) -> None:
    """`line` on stderr in one write, under `_STDERR` (never cut by another thread's line)."""
    with _STDERR:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class PlainProgress:
    """Progress as whole lines on stderr (no carriage returns), for logs and pipes."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.start = self.last = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.done % PROGRESS_EVERY == 0 or now - self.last >= PROGRESS_SECONDS:
            self.last = now
            _say(f"moehal conformance: {self.done}/{self.total} cases, {now - self.start:.0f} s")


@contextmanager
def heartbeat(case_id: str) -> Iterator[None]:
    """While the body runs past `HEARTBEAT_SECONDS`, `moehal conformance: still running ID (N s)`
    on stderr, then again at each multiple of it. A daemon thread writes the lines; it is stopped
    and joined when the body ends (an exception or KeyboardInterrupt too): no line after that."""
    every, start, stop = HEARTBEAT_SECONDS, time.monotonic(), threading.Event()

    def beat() -> None:
        n = 1
        while not stop.wait(max(0.0, start + n * every - time.monotonic())):
            _say(f"moehal conformance: still running {case_id} ({time.monotonic() - start:.0f} s)")
            n += 1

    thread = threading.Thread(target=beat, name="moehal-conformance-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()  # a line being written ends first


class RunningCase(ProgressColumn):
    """The live display's running case and how long it has run (the task's fields `case`, `since`);
    the clock before it is the whole run's."""

    def render(self, task: Task) -> Text:
        case = task.fields.get("case")
        if not case:
            return Text("")
        return Text(f"{case} ({time.monotonic() - task.fields['since']:.0f} s)", no_wrap=True, overflow="ellipsis")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; SIGTERM interrupts it (the report keeps what ran) while it runs, and the
    caller's own SIGTERM handler is back afterwards (a test process calling `main` kept ours,
    which turned a later SIGTERM into an interrupted suite that still passed)."""
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    _interrupt_on_sigterm()
    console = make_console()
    try:
        profile = "quick" if args.quick else "full"
        suite = Suite.create(args.backend, args.device, args.emulate, profile, poison=args.poison)
    except MoEHalError as exc:  # an unknown backend, a device this machine lacks: on stderr
        _error(str(exc))
        return EXIT_USAGE
    try:
        cases = suite.cases()
    except MoEHalError as exc:  # e.g. PluginCheckError: a check of the backend raised
        console.print(f"[red]FAIL[/red]: the suite could not compute its cases: {escape(str(exc))}", highlight=False)
        return EXIT_FAIL
    if args.select:
        cases = [c for c in cases if selected(args.select, c.id)]
        suite.select = args.select  # the reports say the verdict is a subset's
    if args.report:  # before the run, not after minutes of it
        try:
            report.check_writable(args.report)
        except (report.ReportPathError, OSError) as exc:
            _error(f"--report {args.report}: {exc}")
            return EXIT_USAGE
    ep_count = len(suite.ep_case_list(args.ep)) if args.ep else 0  # as -k selects them too
    ep_note = f", then {ep_count} expert-parallel case(s) on {args.ep} processes" if ep_count else ""
    console.print(
        f"moehal conformance: backend [bold]{suite.backend}[/bold] on {suite.device}, {len(cases)} cases{ep_note}"
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), RunningCase())
    plain = None if console.is_terminal else PlainProgress(len(cases))  # a log, a pipe: no live bar
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("running", total=len(cases), case="", since=0.0)

        def tick(r: object) -> None:
            progress.advance(task)
            if plain is not None:
                plain.advance()

        @contextmanager
        def watch(case: Case) -> Iterator[None]:
            progress.update(task, case=case.id, since=time.monotonic())  # the live display's
            try:
                with heartbeat(case.id) if plain is not None else nullcontext():  # a log's
                    yield
            finally:
                progress.update(task, case="")

        suite.run(cases, tick, watch)
    if args.ep and not ep_count:
        console.print(f"expert parallelism: -k {args.select} selects none of its cases", markup=False)
    if ep_count:
        why = "the run was interrupted before the expert-parallel cases"  # a time limit: report now
        if not suite.interrupted:
            console.print(f"expert parallelism: {args.ep} processes")
            try:
                suite.run_ep(args.ep, args.ep_dispatcher)
                if args.ep_dispatcher is None:  # and each of the backend's own dispatchers
                    for disp in suite.ep_dispatchers():
                        console.print(f"expert parallelism behind {disp}", markup=False)
                        suite.run_ep(args.ep, disp, required=False)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM, as Suite.run takes it: keep the report
                suite.interrupted = True
                why = "the run was interrupted during the expert-parallel cases"
        if suite.interrupted:
            disp = args.ep_dispatcher or "reference.torch_distributed"
            suite.results.append(CaseResult(f"ep/world{args.ep}", "ep", "ep", "-", "-", disp, NOT_RUN, detail=why))
    counts = suite.counts()
    t = Table(title=f"conformance: {suite.backend}", title_justify="left")
    for col in ("family", "pass", "fail", "declined", "not run"):
        t.add_column(col, overflow="fold")
    for fam in dict.fromkeys(r.family for r in suite.results):
        rs = [r for r in suite.results if r.family == fam]
        t.add_row(fam, *(str(sum(r.status == s for r in rs)) for s in (PASS, FAIL, "declined", "not run")))
    console.print(t)
    comps = components.summarize(suite)
    if comps:
        ct = Table(title=f"components of {suite.backend}", title_justify="left")
        for col in ("component", "kind", "result", "detail"):
            ct.add_column(col, overflow="fold")
        style = {components.VERIFIED: "green", components.FAILED: "red", components.NOT_RAN: "yellow"}
        for c in comps:
            ct.add_row(c.qualname, c.kind, Text(c.status, style=style.get(c.status, "")), Text(c.detail))
        console.print(ct)
    for r in suite.results:
        if r.status == FAIL or args.show_passing:
            console.print(f"{r.id}: {r.label} {r.detail if r.status == FAIL else ''}", markup=False)
    unwritten = ""
    if args.report:
        try:
            js, md = report.write(suite, args.report)
            console.print(f"reports: {md} {js}", markup=False)
        except (report.ReportPathError, OSError) as exc:  # said after the verdict, which still prints
            unwritten = f"the reports were not written: --report {args.report}: {exc}"
    if suite.lost_in:
        lost = next(r for r in suite.results if r.id == suite.lost_in)
        console.print(lost.traceback, markup=False, highlight=False)
        console.print(
            f"[red]the device's context was lost[/red] in {lost.id}; {counts['not run']} case(s) after it did not run",
            markup=True,
        )
    code = _verdict(console, suite, args, len(cases))
    if unwritten:
        _error(unwritten)
        return code or EXIT_USAGE  # a failure stays a failure: a lost report is not the news
    return code


def _error(text: str) -> None:
    """One error line on stderr (stdout keeps the tables, the reports' paths and the verdict)."""
    make_console(stderr=True).print(
        f"moehal conformance: {text}", style="red", markup=False, highlight=False, soft_wrap=True
    )


def _k_expression(text: str) -> str:
    """`-k`'s argparse type: a well-formed expression (a usage error, exit 2, otherwise)."""
    try:
        selected(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _verdict(console: Console, suite: Suite, args: argparse.Namespace, selected_cases: int) -> int:
    """Print the verdict line; return the exit status."""
    counts = suite.counts()
    if counts[FAIL]:
        console.print(f"[red]FAIL[/red]: {counts[FAIL]} case(s) failed")
        return EXIT_FAIL
    if suite.interrupted:
        console.print(f"[yellow]INCOMPLETE[/yellow]: interrupted; {counts['not run']} case(s) did not run")
        return EXIT_INCOMPLETE
    if not suite.ok:  # the reports' verdict: a -k subset that ran nothing is no pass either
        if args.select:
            picked = f"-k {escape(args.select)}: {selected_cases} case(s) selected"
            console.print(f"[yellow]{picked}, none ran and passed[/yellow]")
        else:
            console.print(f"[yellow]backend {suite.backend} claims no case on this machine: see the declines[/yellow]")
        return EXIT_FAIL
    subset = f" (subset: -k {escape(args.select)})" if args.select else ""
    console.print(
        f"[green]PASS[/green]{subset}: {counts[PASS]} pass, {counts['declined']} declined, {counts['not run']} not run"
    )
    return EXIT_PASS
