"""`pytest --pyargs moehal_conformance --moehal-backend=NAME`: the suite as pytest runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys


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
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp_path)}
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "moehal_conformance", "-p", "no:cacheprovider", "-q",
        "-p", "interrupter", "--moehal-backend=reference", "--moehal-device=cpu", "--moehal-quick",
        "-k", "matrix and bf16", f"--moehal-report={tmp_path / 'ref'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]  # pytest's INTERRUPTED
    data = json.loads((tmp_path / "ref.json").read_text())
    summary = data["summary"]
    assert data["interrupted"] is True and summary["ok"] is False and data["select"] == "matrix and bf16"
    assert summary["pass"] == 2 and summary["fail"] == 0 and summary["not run"] > 0
    not_run = [c for c in data["cases"] if c["status"] == "not run"]
    assert all(c["id"].startswith("matrix/bf16") and "interrupted" in c["detail"] for c in not_run)
    md = (tmp_path / "ref.md").read_text()
    assert "**Verdict: INCOMPLETE (interrupted), subset (-k `matrix and bf16`)**" in md
