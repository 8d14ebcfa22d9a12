"""`moehal conformance` as a command: report paths, streams, exit codes, progress, `-k`."""

from __future__ import annotations

import json

import pytest
from moehal_conformance import report
from moehal_conformance.cli import main as conformance_main
from moehal_conformance.suite import Suite

BASE = ["--backend", "reference", "--device", "cpu", "--quick"]
SILU = ["-k", "matrix/bf16/silu/"]  # 3 cases, a few seconds


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if the suite starts running cases."""

    def run(self, *args, **kwargs):
        raise AssertionError("the suite ran before the report path was checked")

    monkeypatch.setattr(Suite, "run", run)


def test_an_unwritable_report_path_exits_2_before_the_run(tmp_path, capsys, no_run):
    """`--report /proc/nope/r` ran the whole suite, then died of a FileNotFoundError traceback."""
    (tmp_path / "afile").write_text("x")
    code = conformance_main([*BASE, *SILU, "--report", str(tmp_path / "afile" / "r")])
    out, err = capsys.readouterr()
    assert code == 2
    assert "--report" in err and str(tmp_path / "afile") in err and "Traceback" not in err
    assert "cases" not in out  # nothing ran: no header, no table


@pytest.mark.parametrize("report", [".", "..", "runs/.."])
def test_a_report_path_that_names_no_file_exits_2_before_the_run(report, tmp_path, capsys, monkeypatch, no_run):
    """`--report .` wrote hidden `./.json` and `./.md` (bench's --out refused it): one rule now,
    `moehal.cli.common.output_files`."""
    monkeypatch.chdir(tmp_path)
    assert conformance_main([*BASE, *SILU, "--report", report]) == 2
    assert f"{report!r} names no file" in capsys.readouterr().err
    assert not list(tmp_path.rglob(".json")) and not list(tmp_path.rglob(".md"))


def test_a_report_that_fails_to_write_still_prints_the_verdict_then_exits_2(tmp_path, capsys, monkeypatch):
    def refused(suite, path):
        raise PermissionError(13, "Permission denied", str(path) + ".json")

    monkeypatch.setattr(report, "write", refused)
    code = conformance_main([*BASE, *SILU, "--report", str(tmp_path / "r")])
    out, err = capsys.readouterr()
    assert code == 2
    assert "PASS (subset: -k matrix/bf16/silu/)" in " ".join(out.split())
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Permission denied" in lines[0] and "not written" in lines[0], err


def test_a_failed_or_interrupted_run_keeps_its_exit_status_when_its_report_fails_to_write(
    tmp_path, capsys, monkeypatch
):
    """A report that failed to write turned FAIL (1) and INCOMPLETE (3) into 2, the usage error:
    a CI job that reads 2 as its own mistake lost the failure."""
    from moehal_conformance import cli

    def refused(suite, path):
        raise PermissionError(13, "Permission denied", str(path) + ".json")

    monkeypatch.setattr(report, "write", refused)
    for verdict in (cli.EXIT_FAIL, cli.EXIT_INCOMPLETE):
        monkeypatch.setattr(cli, "_verdict", lambda *args, code=verdict: code)
        assert conformance_main([*BASE, *SILU, "--report", str(tmp_path / "r")]) == verdict
        assert "not written" in capsys.readouterr().err


def test_a_report_write_that_stops_midway_leaves_the_previous_report_whole(tmp_path, monkeypatch):
    """The reports were written in place: a time limit or a full disk mid-write left a truncated
    JSON, which the next run with the same --report then refused as not a report (exit 2)."""
    import pathlib

    suite = Suite.create("reference", "cpu", profile="quick")
    js, md = report.write(suite, tmp_path / "ref")
    before = js.read_text()
    real = pathlib.Path.write_text

    def full(self, text, *args, **kwargs):
        real(self, text[:20], *args, **kwargs)  # part of it, then the disk is full
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(OSError, match="No space left"):
        report.write(suite, tmp_path / "ref")
    monkeypatch.undo()
    assert js.read_text() == before and report.is_report(js) and report.is_report(md)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.json", "ref.md"]  # no part file left
    report.check_writable(tmp_path / "ref")  # the next run may write there


def test_the_report_folder_is_made_when_the_report_is_written_not_before_the_run(tmp_path, capsys, monkeypatch):
    """The check of the --report path made its folder before the run: a run stopped or refused
    before its report (a Ctrl-C outside a case, a crash) left an empty folder behind."""
    path = tmp_path / "new" / "sub" / "r"
    assert report.check_writable(path) == (path.with_suffix(".json"), path.with_suffix(".md"))
    assert not (tmp_path / "new").exists()  # checked, not made
    (tmp_path / "afile").write_text("x")
    with pytest.raises(report.ReportPathError, match="afile: not a directory"):  # still refused
        report.check_writable(tmp_path / "afile" / "sub" / "r")

    def stopped(self, *args, **kwargs):
        raise KeyboardInterrupt  # as a Ctrl-C that lands between the check and the report

    with monkeypatch.context() as m:
        m.setattr(Suite, "run", stopped)
        with pytest.raises(KeyboardInterrupt):
            conformance_main([*BASE, *SILU, "--report", str(path)])
    assert not (tmp_path / "new").exists()
    assert conformance_main([*BASE, *SILU, "--report", str(path)]) == 0  # a good run writes as before
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json", "r.md"]
    assert json.loads(path.with_suffix(".json").read_text())["summary"]["verdict"].startswith("PASS")
    assert f"reports: {path.with_suffix('.md')} {path.with_suffix('.json')}" in capsys.readouterr().out


@pytest.mark.parametrize("world", ["-2", "x"])
def test_ep_takes_a_world_size_of_0_or_more(world, capsys, no_run):
    with pytest.raises(SystemExit) as info:
        conformance_main([*BASE, "--ep", world])
    assert info.value.code == 2 and "--ep" in capsys.readouterr().err


def test_report_refuses_to_overwrite_a_file_that_is_not_a_report(tmp_path, capsys, no_run):
    """`--report /work/main/README` overwrote the project's README.md with a report."""
    readme = tmp_path / "README.md"
    readme.write_text("# My project\n")
    code = conformance_main([*BASE, *SILU, "--report", str(tmp_path / "README")])
    err = capsys.readouterr().err
    assert code == 2 and str(readme) in err and "not a moehal conformance report" in err
    assert readme.read_text() == "# My project\n"
    data = tmp_path / "data.json"
    data.write_text('{"summary": 1}')  # JSON, but not a report's
    assert conformance_main([*BASE, *SILU, "--report", str(tmp_path / "data")]) == 2
    assert data.read_text() == '{"summary": 1}' and not (tmp_path / "data.md").exists()


def test_report_write_overwrites_its_own_reports_only(tmp_path):
    suite = Suite.create("reference", "cpu", profile="quick")
    js, md = report.write(suite, tmp_path / "ref")
    assert report.is_report(js) and report.is_report(md)
    js2, md2 = report.write(suite, tmp_path / "ref")  # a previous report: overwritten
    assert (js2, md2) == (js, md) and json.loads(js.read_text())["backend"] == "reference"
    (tmp_path / "notes.md").write_text("notes\n")
    with pytest.raises(report.ReportPathError, match="notes.md"):
        report.write(suite, tmp_path / "notes")
    assert (tmp_path / "notes.md").read_text() == "notes\n" and not (tmp_path / "notes.json").exists()
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(report.ReportPathError, match="not a file"):
        report.check_writable(tmp_path / "dir")


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["--backend", "nosuch"], "unknown backend 'nosuch'"), (["--backend", "reference", "--device", "bogus"], "bogus")],
)
def test_invocation_errors_go_to_stderr(argv, said, capsys):
    """They were printed on stdout, among the tables and the verdict a log or a pipe keeps."""
    assert conformance_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and said in err


def test_narrow_terminals_wrap_component_names_never_cut_them(monkeypatch, capsys):
    """At COLUMNS=60 the components table printed `reference.torc…` and `--ep-dispatch…`."""
    monkeypatch.setenv("COLUMNS", "60")
    assert conformance_main([*BASE, *SILU]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    table = out[out.index("components of reference") :].splitlines()
    rows: list[list[str]] = []
    for line in table:
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[1]:  # a new row starts where its kind is given
            rows.append(cells)
        else:  # a folded row's next line: glue each cell's pieces back together
            rows[-1] = [a + b for a, b in zip(rows[-1], cells)]
    names = {r[0]: r[2] for r in rows}
    assert names["reference.torch_distributed"] == "not run" and names["reference.experts"] == "verified"
    detail = next(r[3] for r in rows if r[0] == "reference.torch_distributed")
    assert "--ep-dispatcher" in detail


@pytest.mark.parametrize(("every", "seconds"), [(2, 1e9), (10**6, 0.0)])  # by count, by time
def test_a_run_into_a_pipe_prints_plain_progress_lines_on_stderr(every, seconds, monkeypatch, capsys):
    """Where the output is no terminal the live bar draws nothing: a 132-case run was silent for 50 s."""
    from moehal_conformance import cli

    monkeypatch.setattr(cli, "PROGRESS_EVERY", every)
    monkeypatch.setattr(cli, "PROGRESS_SECONDS", seconds)
    assert conformance_main([*BASE, *SILU]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    want = ["2/3"] if every == 2 else ["1/3", "2/3", "3/3"]
    assert [line.split()[2] for line in lines] == want, err
    assert all(line.startswith("moehal conformance: ") and line.endswith(" s") for line in lines)
    assert "\r" not in err and "cases, " not in out


HEARTBEAT_THREAD = "moehal-conformance-heartbeat"


def _one_slow_case(monkeypatch, until, then: BaseException | None = None) -> list[str]:
    """Cases that pass at once, but the first, which runs until `until()` holds (polled; at most
    10 s, so a loaded CI machine's late thread cannot fail a timing window), then raises `then`,
    if given; returns the slow case's id once it ran. `HEARTBEAT_SECONDS` is lowered to 0.1 s."""
    import time

    from moehal_conformance import cli
    from moehal_conformance.runner import PASS, CaseResult, CaseRunner

    slow: list[str] = []

    def run(self, case):
        if not slow:
            slow.append(case.id)
            deadline = time.monotonic() + 10
            while not until() and time.monotonic() < deadline:
                time.sleep(0.01)
            if then is not None:
                raise then
        return CaseResult(case.id, case.family, case.check, case.quant.name, case.layout, "fake", PASS)

    monkeypatch.setattr(CaseRunner, "run", run)
    monkeypatch.setattr(cli, "HEARTBEAT_SECONDS", 0.1, raising=False)
    return slow


def _count_beats(monkeypatch) -> list[str]:
    """The heartbeat lines said from now on (cli._say still writes them)."""
    from moehal_conformance import cli

    said: list[str] = []
    real = cli._say

    def say(line: str) -> None:
        real(line)
        if "still running" in line:
            said.append(line)

    monkeypatch.setattr(cli, "_say", say)
    return said


def _heartbeat_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == HEARTBEAT_THREAD]


def test_a_case_that_runs_long_says_so_in_a_log_while_it_runs(monkeypatch, capsys):
    """Progress lines came between cases only: a case of minutes (or a hung one) printed
    nothing, and a CI log read as a hang. Past HEARTBEAT_SECONDS, a line names the running case,
    again at each multiple; none after the case ends."""
    import re

    from moehal_conformance import cli

    said = _count_beats(monkeypatch)
    slow = _one_slow_case(monkeypatch, lambda: len(said) >= 2)
    monkeypatch.setattr(cli, "PROGRESS_EVERY", 1)  # each case's end is a line too
    assert conformance_main([*BASE, *SILU]) == 0
    lines = capsys.readouterr().err.splitlines()
    beats = [re.fullmatch(r"moehal conformance: still running (\S+) \((\d+) s\)", line) for line in lines[:-3]]
    assert all(beats) and len(beats) >= 2, lines  # at 0.1, 0.2 s, ...: whole lines, one each time
    assert {m.group(1) for m in beats} == set(slow), lines
    assert [line.split()[2] for line in lines[-3:]] == ["1/3", "2/3", "3/3"], lines  # none after its end
    assert _heartbeat_threads() == []


def test_the_heartbeat_stops_when_a_case_is_interrupted(monkeypatch, capsys):
    import time

    said = _count_beats(monkeypatch)
    _one_slow_case(monkeypatch, lambda: len(said) >= 1, then=KeyboardInterrupt())
    assert conformance_main([*BASE, *SILU]) == 3  # INCOMPLETE
    said = capsys.readouterr().err.count("still running")
    assert said >= 1 and _heartbeat_threads() == []
    time.sleep(0.3)
    assert "still running" not in capsys.readouterr().err


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_the_heartbeat_thread_is_stopped_by_an_exception_in_its_body(error, monkeypatch, capsys):
    import time

    from moehal_conformance import cli

    monkeypatch.setattr(cli, "HEARTBEAT_SECONDS", 0.05)
    said = _count_beats(monkeypatch)
    with pytest.raises(error):
        with cli.heartbeat("shapes/x"):
            deadline = time.monotonic() + 10
            while not said and time.monotonic() < deadline:
                time.sleep(0.01)
            raise error
    assert capsys.readouterr().err.startswith("moehal conformance: still running shapes/x (0 s)\n")
    assert _heartbeat_threads() == []
    time.sleep(0.15)
    assert capsys.readouterr().err == ""


def test_on_a_terminal_the_live_display_shows_the_running_case_and_its_time(monkeypatch, capsys):
    """On a terminal the bar showed the cases done and the run's clock: a slow case was a bar
    that did not move. The running case's id and its own time show beside it, no heartbeat
    line."""
    import io

    from moehal_conformance import cli
    from rich.console import Console

    screen = io.StringIO()
    real = cli.make_console
    monkeypatch.setattr(
        cli, "make_console", lambda **kw: real(**kw) if kw else Console(file=screen, force_terminal=True, width=200)
    )
    box: list[list[str]] = []  # the display redraws 10 times a second: the case runs until it shows
    box.append(_one_slow_case(monkeypatch, lambda: bool(box[0]) and f"{box[0][0]} (0 s)" in screen.getvalue()))
    slow = box[0]
    assert conformance_main([*BASE, *SILU]) == 0
    assert f"{slow[0]} (0 s)" in screen.getvalue()
    assert "still running" not in capsys.readouterr().err


def test_the_running_case_column_reads_the_case_and_its_start():
    import time

    from moehal_conformance.cli import RunningCase
    from rich.progress import Progress

    with Progress(RunningCase(), disable=True) as progress:
        task = progress.add_task("running", case="tuned/x", since=time.monotonic() - 65)
        assert RunningCase().render(progress.tasks[task]).plain == "tuned/x (65 s)"
        progress.update(task, case="")  # between cases: nothing
        assert RunningCase().render(progress.tasks[task]).plain == ""


def test_an_interrupted_run_exits_3_not_as_a_failure(monkeypatch, tmp_path, capsys):
    """Ctrl-C or a time limit's SIGTERM (INCOMPLETE) exited 1, as a failed run does."""
    from moehal_conformance.runner import CaseRunner

    real, ran = CaseRunner.run, []

    def run(self, case):
        if ran:
            raise KeyboardInterrupt  # as SIGTERM arrives through the CLI's handler
        ran.append(case.id)
        return real(self, case)

    monkeypatch.setattr(CaseRunner, "run", run)
    code = conformance_main([*BASE, *SILU, "--report", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 3 and "INCOMPLETE" in out.strip().splitlines()[-1]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["pass"] == 1 and data["summary"]["not run"] == 2 and data["interrupted"] is True


def test_the_help_lists_every_exit_status(capsys):
    from moehal_conformance.cli import build_parser

    text = build_parser().format_help()
    codes = [line.split()[:2] for line in text[text.index("exit status:") :].splitlines()[1:] if line[:3].strip()]
    assert codes == [["0", "PASS:"], ["1", "FAIL:"], ["2", "usage"], ["3", "INCOMPLETE:"]], text


def _fake_ranks(monkeypatch):
    """Stand in for the spawned ranks: each EP case it is handed passes; returns the names handed."""
    import types

    import moehal.distributed_check as dc

    handed: list[list[str]] = []

    def run_spawned(world, fn, args=(), **kwargs):
        cases = args[0] if args[0] is not None else dc.ep_cases(world)  # None: all (the old call)
        handed.append([c.name for c in cases])
        res = [
            types.SimpleNamespace(
                case=c.name, declined="", all_ok=True, pipeline="p", mode="native", max_abs_err=0.0,
                tolerance="tol", detail="",
            )
            for c in cases
        ]  # fmt: skip
        return [dc.RankOutcome(r, "ok", res) for r in range(world)]

    monkeypatch.setattr(dc, "run_spawned", run_spawned)
    return handed


def test_k_selects_the_expert_parallel_cases_too(monkeypatch, tmp_path, capsys):
    """`-k` did not filter `--ep`: all 20 EP cases ran whatever it said."""
    handed = _fake_ranks(monkeypatch)
    # "slots": 3 shapes cases (no_local_slots) and one EP case ("-1 ids: padded tokens and slots")
    code = conformance_main([*BASE, "-k", "slots", "--ep", "2", "--report", str(tmp_path / "r")])
    assert code == 0, capsys.readouterr()
    assert handed and all(names == ["-1 ids: padded tokens and slots"] for names in handed), handed
    data = json.loads((tmp_path / "r.json").read_text())
    ep = [c["id"] for c in data["cases"] if c["family"] == "ep"]
    assert ep and all(i == "ep/world2/-1 ids: padded tokens and slots" for i in ep), ep
    assert data["summary"]["subset"] is True and data["summary"]["verdict"] == "PASS, subset (-k `slots`)"
    handed.clear()
    assert conformance_main([*BASE, *SILU, "--ep", "2", "--report", str(tmp_path / "s")]) == 0
    assert handed == []  # no EP case has "matrix/bf16/silu/" in its id: no rank was spawned
    assert "selects none of its cases" in capsys.readouterr().out
    assert not [c for c in json.loads((tmp_path / "s.json").read_text())["cases"] if c["family"] == "ep"]


def _reports_hook():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "reports_hook", Path(__file__).resolve().parents[2] / "docs" / "_hooks" / "reports.py"
    )
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_the_json_report_names_its_schema_and_readers_take_it_with_or_without(tmp_path):
    suite = Suite.create("reference", "cpu", profile="quick")
    js, _ = report.write(suite, tmp_path / "docs" / "new")
    data = json.loads(js.read_text())
    assert next(iter(data)) == "schema" and data["schema"] == "moehal.conformance/1"
    old = {k: v for k, v in data.items() if k != "schema"}  # as reports before session 58 are
    (tmp_path / "docs" / "old.json").write_text(json.dumps(old))
    hook = _reports_hook()
    for name in ("new.json", "old.json"):
        assert report.is_report(tmp_path / "docs" / name)
        table = hook._components(tmp_path / "docs", tmp_path / "docs", name)
        assert "Backend `reference`" in table and "| `reference.experts` | experts |" in table, table
    (tmp_path / "docs" / "v2.json").write_text(json.dumps({**data, "schema": "moehal.conformance/2"}))
    with pytest.raises(ValueError, match="moehal.conformance/2"):
        hook._components(tmp_path / "docs", tmp_path / "docs", "v2.json")


def test_the_docs_components_table_escapes_a_plugins_text(tmp_path):
    """The docs hook publishes a committed report's components table: a plugin's detail and
    names there are escaped as the report's Markdown escapes them (security review, finding 11)."""
    suite = Suite.create("reference", "cpu", profile="quick")
    js, _ = report.write(suite, tmp_path / "r")
    data = json.loads(js.read_text())
    data["hardware"]["name"] = "<b>GPU</b>"
    data["components"][0].update(kind="<i>experts</i>", detail="<script>x()</script>\n| [a](javascript:y())")
    js.write_text(json.dumps(data))
    table = _reports_hook()._components(tmp_path, tmp_path, "r.json")
    assert "<" not in table and "[a](" not in table
    assert "on &lt;b&gt;GPU&lt;/b&gt; (" in table
    assert (
        "| &lt;i&gt;experts&lt;/i&gt; |" in table and "&lt;script&gt;x()&lt;/script&gt; \\| [a\\](javascript" in table
    )


@pytest.mark.parametrize(
    "select, case_id, expected",
    [
        ("shapes/ and contiguous", "shapes/bf16/tokens_0/deepgemm[contiguous[bfloat16 align 128]]", True),
        ("shapes/ and contiguous", "shapes/bf16/tokens_0/deepgemm[masked[bfloat16 align 64]]", False),
        ("not tuned/", "matrix/bf16/silu/x", True),  # as before: one text, or 'not TEXT'
        ("tuned/", "matrix/bf16/silu/x", False),
        ("bf16 standard", "ep/world2/bf16 standard", True),  # a text keeps its spaces
        ("(fp8 or int8) and not tuned/", "matrix/fp8_block/silu/x", True),
        ("(fp8 or int8) and not tuned/", "tuned/qwen/fp8_block/x", False),
        ("not not shapes/", "shapes/x", True),
    ],
)
def test_k_combines_texts_as_pytests_k_does(select, case_id, expected):
    """Session 58's device call 5 ran `-k "shapes/ and contiguous"` and got NOTHING RAN: `-k`
    took one substring (or 'not TEXT'), so the expression matched no id. It reads pytest's
    `and`, `or`, `not` and parentheses now; a plain text still means what it meant."""
    from moehal_conformance.suite import selected

    assert selected(select, case_id) is expected


@pytest.mark.parametrize("select", ["shapes/ and", "(fp8", "fp8 )", "and fp8", "not"])
def test_a_malformed_k_is_a_usage_error_before_the_run(select, capsys, no_run):
    with pytest.raises(SystemExit) as info:
        conformance_main([*BASE, "-k", select])
    assert info.value.code == 2 and f"-k {select!r}" in capsys.readouterr().err
