"""The pytest face of the suite (entry point `pytest11`):

    pytest --pyargs moehal_conformance --moehal-backend=NAME [--moehal-report=PATH]

Inert unless `--moehal-backend` is given, so it never changes other test sessions.
Declined and not-run cases are reported as skips whose reason starts with `declined:` or
`not run:`; the report file lists them too. The terminal summary ends with the backend's
components, verified or not run and why (`moehal_conformance.components`). A report that fails
to write at the end is one line on stderr, and a passing session then exits 4 (pytest's usage
error, as for a `--moehal-report` path refused before the session).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from moehal_conformance.suite import Suite

_PACKAGE_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moehal", "moehal conformance")
    group.addoption("--moehal-backend", default=None, help="backend to prove (or 'best')")
    group.addoption("--moehal-device", default=None, help="device (default: the best torch sees)")
    group.addoption("--moehal-report", default=None, help="write PATH.json and PATH.md at the end")
    group.addoption("--moehal-emulate", action="store_true", help="allow the backend's emulated mode")
    group.addoption("--moehal-quick", action="store_true", help="fewer shape cases")
    group.addoption(
        "--moehal-no-poison", action="store_true", help="leave fresh allocations unpoisoned (see poison.py)"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("moehal_backend") is None and _PACKAGE_DIR in Path(collection_path).resolve().parents:
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    backend = config.getoption("moehal_backend")
    if backend is None:
        return
    from moehal_conformance import report
    from moehal_conformance.suite import Suite

    path = config.getoption("moehal_report")
    if path:  # before the session, as the CLI checks it: not after the cases ran
        try:
            report.check_writable(path)
        except (report.ReportPathError, OSError) as exc:
            raise pytest.UsageError(f"--moehal-report={path}: {exc}") from None
    profile = "quick" if config.getoption("moehal_quick") else "full"
    poison = not config.getoption("moehal_no_poison")
    device, emulate = config.getoption("moehal_device"), config.getoption("moehal_emulate")
    suite = Suite.create(backend, device, emulate, profile, poison=poison)
    suite.select = config.getoption("keyword") or None  # a -k subset's report says so
    config._moehal_suite = suite  # type: ignore[attr-defined]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "moehal_case" in metafunc.fixturenames:
        suite = getattr(metafunc.config, "_moehal_suite", None)
        if suite is None:  # collected from a source tree (an sdist) without --moehal-backend
            skip = pytest.mark.skip(reason="the conformance suite runs with --moehal-backend=NAME")
            metafunc.parametrize("moehal_case", [pytest.param(None, marks=skip)], ids=["no-backend"])
            return
        cases = suite.cases()
        metafunc.config._moehal_case_count = len(cases)  # type: ignore[attr-defined]
        metafunc.parametrize("moehal_case", cases, ids=[c.id for c in cases])


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run of some of the cases (node ids, `-m`, `--deselect`, `--lf`: any selection but
    `-k`, which `pytest_configure` records) is a subset too, and its report says so."""
    suite = getattr(session.config, "_moehal_suite", None)
    total = getattr(session.config, "_moehal_case_count", None)
    if suite is None or total is None or suite.select:
        return
    ids = [c.params["moehal_case"].id for c in _callspecs(session.items)]
    if len(ids) < total:
        suite.select = ", ".join(ids) if len(ids) <= 3 else f"{len(ids)} of {total} cases"
        suite.select_by = "pytest selection:"


def _callspecs(items: list[pytest.Item]) -> list[Any]:
    """The parametrization of each conformance case among `items` (pytest's CallSpec2)."""
    specs = [getattr(i, "callspec", None) for i in items]
    return [c for c in specs if c is not None and "moehal_case" in c.params]


@pytest.fixture(scope="session")
def moehal_suite(request: pytest.FixtureRequest) -> Suite:
    suite = getattr(request.config, "_moehal_suite", None)
    if suite is None:  # collected from a source tree (an sdist) without --moehal-backend
        pytest.skip("the conformance suite runs with --moehal-backend=NAME")
    return suite


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    suite = getattr(session.config, "_moehal_suite", None)
    path = session.config.getoption("moehal_report", None)
    if suite is not None and path and suite.results:
        from moehal_conformance import report

        if exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop:
            # Ctrl-C, SIGTERM or -x: keep what ran, say what did not, as the CLI does
            suite.interrupted = True
            done = {r.id for r in suite.results}
            cases = [c.params["moehal_case"] for c in _callspecs(getattr(session, "items", []))]
            suite._not_run([c for c in cases if c.id not in done], "the run was interrupted before this case")
        try:
            report.write(suite, path)
        except (report.ReportPathError, OSError) as exc:  # a full disk: one line, not a traceback
            # as the CLI: a passing session's lost report is a usage error (pytest's is 4); a
            # failed or interrupted session keeps its own status
            sys.stderr.write(f"moehal conformance: the reports were not written: --moehal-report={path}: {exc}\n")
            if exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.USAGE_ERROR


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    suite = getattr(config, "_moehal_suite", None)
    if suite is None or not suite.results:
        return
    from moehal_conformance import components

    terminalreporter.section(f"moehal conformance: components of {suite.backend}")
    for c in components.summarize(suite):
        terminalreporter.line(f"{c.qualname} ({c.kind}): {c.label}")
