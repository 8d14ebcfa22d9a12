"""`pytest --pyargs moehal_conformance --moehal-backend=NAME`: the suite as pytest runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_pytest_face_runs_cases_writes_the_report_and_lists_components(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "moehal_conformance", "-p", "no:cacheprovider", "-q",
        "--moehal-backend=reference", "--moehal-device=cpu", "--moehal-quick", "-k", "matrix and bf16 and silu",
        f"--moehal-report={tmp_path / 'ref'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "ref.json").read_text())
    passed = data["summary"]["pass"]
    assert passed > 0 and data["summary"]["fail"] == 0
    assert all(c["id"].startswith("matrix/bf16/silu") for c in data["cases"])
    assert f"{passed} passed" in done.stdout
    assert "moehal conformance: components of reference" in done.stdout
    assert "reference.experts (experts): verified" in done.stdout
    assert "reference.torch_distributed (dispatcher): not run: [parallel]" in done.stdout


def test_an_interrupted_pytest_session_reports_incomplete(tmp_path):
    """pytest writes the report at session finish whatever the exit status: a session stopped
    after two cases (Ctrl-C, or SIGTERM from a time limit) was published as "Verdict: PASS"."""
    (tmp_path / "interrupter.py").write_text(
        "passed = []\n\n\n"
        "def pytest_runtest_logreport(report):\n"
        "    if report.when == 'call' and report.passed:\n"
        "        passed.append(report.nodeid)\n"
        "        if len(passed) == 2:\n"
        "            raise KeyboardInterrupt\n"
    )
    done = _run_with_plugin(tmp_path, "interrupter", "matrix and bf16")
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]  # pytest's INTERRUPTED
    data = json.loads((tmp_path / "ref.json").read_text())
    summary = data["summary"]
    assert data["interrupted"] is True and summary["ok"] is False and data["select"] == "matrix and bf16"
    assert summary["pass"] == 2 and summary["fail"] == 0 and summary["not run"] > 0
    not_run = [c for c in data["cases"] if c["status"] == "not run"]
    assert all(c["id"].startswith("matrix/bf16") and "interrupted" in c["detail"] for c in not_run)
    md = (tmp_path / "ref.md").read_text()
    assert "**Verdict: INCOMPLETE (interrupted), subset (-k `matrix and bf16`)**" in md


@pytest.mark.parametrize(("fail", "code"), [(False, 4), (True, 1)])
def test_a_report_that_fails_to_write_at_the_pytest_faces_end_is_one_line(tmp_path, fail, code):
    """A disk error at session finish was a 70-line traceback, the summary line lost and exit
    status 1 (Python's, for an uncaught exception) on a session whose cases all passed. As the
    CLI: one line on stderr; a passing session exits with pytest's usage error (4), a failed one
    keeps its 1."""
    (tmp_path / "diskfull.py").write_text(
        "def pytest_configure(config):\n"
        "    from moehal_conformance import report, runner\n\n"
        "    def full(path, write):\n"
        "        raise OSError(28, 'No space left on device', str(path))\n\n"
        "    report.replace_file = full\n"
        f"    if {fail}:\n"
        "        real = runner.CaseRunner.run\n\n"
        "        def run(self, case):\n"
        "            r = real(self, case)\n"
        "            r.status, r.detail = runner.FAIL, 'made to fail'\n"
        "            return r\n\n"
        "        runner.CaseRunner.run = run\n"
    )
    done = _run_with_plugin(tmp_path, "diskfull", "matrix and bf16 and silu")
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("6 failed" if fail else "6 passed") in done.stdout.splitlines()[-1], done.stdout[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("moehal conformance: the reports were not written: --moehal-report=")
    assert "No space left on device" in line and "Traceback" not in done.stderr + done.stdout
    assert not list(tmp_path.glob("ref*"))


def _run_with_plugin(tmp_path: Path, plugin: str, select: str) -> subprocess.CompletedProcess:
    """The pytest face on the reference backend (CPU, quick, `-k select`, report at tmp_path/ref)
    with `tmp_path/<plugin>.py` loaded as a pytest plugin."""
    # prepended: PYTHONPATH may be what maps the packages onto the tree under test
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), *_pythonpath()])}
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "moehal_conformance", "-p", "no:cacheprovider", "-q",
        "-p", plugin, "--moehal-backend=reference", "--moehal-device=cpu", "--moehal-quick",
        "-k", select, f"--moehal-report={tmp_path / 'ref'}",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def test_a_pytest_run_of_one_node_id_is_reported_as_a_subset(tmp_path):
    """Selected by node id (not -k), one case's pass was published as the backend's "Verdict: PASS"."""
    import moehal_conformance

    case = "matrix/bf16/silu/experts[standard[bfloat16]]"
    node = f"{Path(moehal_conformance.__file__).parent / 'test_conformance.py'}::test_case[{case}]"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable, "-m", "pytest", node, "-p", "no:cacheprovider", "-q", "--moehal-backend=reference",
        "--moehal-device=cpu", "--moehal-quick", f"--moehal-report={tmp_path / 'one'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout
    data = json.loads((tmp_path / "one.json").read_text())
    summary = data["summary"]
    assert [c["id"] for c in data["cases"]] == [case] and summary["pass"] == 1
    assert summary["subset"] is True and data["select"] == case and data["select_by"] == "pytest selection:"
    assert summary["verdict"] == f"PASS, subset (pytest selection: `{case}`)"
    assert f"**Verdict: PASS, subset (pytest selection: `{case}`)**" in (tmp_path / "one.md").read_text()


def test_the_pytest_face_refuses_a_report_path_over_a_file_that_is_not_a_report(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# My project\n")
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "moehal_conformance", "-p", "no:cacheprovider", "-q",
        "--moehal-backend=reference", "--moehal-device=cpu", "--moehal-quick", "-k", "matrix and bf16 and silu",
        f"--moehal-report={tmp_path / 'README'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]  # pytest's USAGE_ERROR, nothing ran
    assert "not a moehal conformance report" in done.stderr and "passed" not in done.stdout
    assert readme.read_text() == "# My project\n"


def test_a_pytest_session_that_writes_no_report_leaves_no_folder(tmp_path):
    """`--moehal-report` made its folder when pytest started: a session that ran no case (a -k
    that selects none, a collection error) wrote no report and left the empty folder."""
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "moehal_conformance", "-p", "no:cacheprovider", "-q",
        "--moehal-backend=reference", "--moehal-device=cpu", "--moehal-quick", "-k", "no_such_case",
        f"--moehal-report={tmp_path / 'new' / 'ref'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 5, done.stdout[-3000:] + done.stderr[-3000:]  # pytest's NO_TESTS_COLLECTED
    assert "deselected" in done.stdout and not (tmp_path / "new").exists()
