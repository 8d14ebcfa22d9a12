"""CI runs the conformance suite against every backend this CPU machine can run:
the reference natively, the NPU backend in its explicit emulated mode, and the ROCm
backend's Triton path under the Triton interpreter (TRITON_INTERPRET=1). Reports land in
$MOEHAL_REPORT_DIR when set (CI keeps them), else in a temp dir."""

from __future__ import annotations

import os
from pathlib import Path

import moehal
import pytest
import torch
from moehal_conformance import report
from moehal_conformance.suite import Suite


def _run(backend: str, emulate: bool, profile: str, tmp_path: Path, ep: int = 0) -> Suite:
    suite = Suite.create(backend, "cpu", emulate=emulate, profile=profile)
    suite.run()
    if ep:
        suite.run_ep(ep)
    out = Path(os.environ.get("MOEHAL_REPORT_DIR", tmp_path))
    js, md = report.write(suite, out / f"conformance-{backend}-cpu")
    assert js.exists() and md.exists()
    return suite


def _assert_green(suite: Suite) -> None:
    failures = [f"{r.id}: {r.detail}" for r in suite.results if r.status == "fail"]
    assert not failures, "\n".join(failures[:20])
    assert suite.claimed_anything, f"{suite.backend} claimed no case"


def test_reference_full(tmp_path):
    suite = _run("reference", False, "full", tmp_path, ep=2)
    assert sum(r.family == "ep" and r.status == "pass" for r in suite.results) >= 10
    _assert_green(suite)
    assert {r.status for r in suite.results} <= {"pass", "not run"}, "the reference claims every case"


def test_npu_emulated(tmp_path):
    suite = _run("npu", True, "full", tmp_path, ep=2)
    _assert_green(suite)
    passed = [r for r in suite.results if r.status == "pass" and r.family != "honesty"]
    assert all(r.mode == "emulated" for r in passed), "every NPU pass must be labelled emulated"
    assert {"bf16", "w8a8_int8"} <= {r.quant for r in passed}
    assert any(r.layout == "fused" for r in passed), "the FuseEP path must run"
    assert any(r.family == "ep" for r in passed), "NPU experts must run behind the generic EP dispatcher"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU machine")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for CPU machines")
def test_rocm_triton_interpreted(tmp_path):
    suite = _run("rocm", False, "quick", tmp_path)
    _assert_green(suite)
    modes = {r.mode for r in suite.results if r.status == "pass" and "triton" in r.pipeline}
    assert modes == {"interpreted"}, f"the Triton path must run (interpreted), saw {modes}"


def test_npu_hccl_dispatcher_emulated_takes_the_any_layout_cases():
    """Ascend's HCCL dispatcher produces its own flat layout and needs max_tokens: session 45's
    audit found it declining every EP case (each pinned a core layout) while the run said PASS."""
    suite = Suite.create("npu", "cpu", emulate=True, profile="quick")
    suite.run_ep(2, "npu.hccl")
    ran = [r for r in suite.results if r.status == "pass"]
    assert len(ran) == 2 and all("npu.hccl" in r.pipeline and r.mode == "emulated" for r in ran), [
        (r.id, r.status, r.pipeline) for r in suite.results
    ]
    assert not [r for r in suite.results if r.status == "fail"]


def test_emulate_reaches_the_ep_ranks_whatever_the_environment_says(monkeypatch):
    """`--emulate` is an argument, so it outranks the variables. The suite handed it to its EP
    ranks by writing MOEHAL_EMULATE into os.environ around the spawn: process-wide, and beside
    MOEHAL_NPU_EMULATE=0 every rank's `Settings.from_env()` refused the two (ConfigError), so
    every EP case failed (security review 2026-11-29, finding 9). The ranks get the suite's
    settings as an argument now, and the environment is not touched."""
    monkeypatch.delenv("MOEHAL_EMULATE", raising=False)
    monkeypatch.setenv("MOEHAL_NPU_EMULATE", "0")
    with pytest.warns(moehal.DeprecatedSettingWarning):
        suite = Suite.create("npu", "cpu", emulate=True, profile="quick")
    before = dict(os.environ)
    suite.run_ep(2, "npu.hccl")
    assert dict(os.environ) == before
    assert not [r for r in suite.results if r.status == "fail"], [r.detail for r in suite.results]
    ran = [r for r in suite.results if r.status == "pass"]
    assert len(ran) == 2 and all(r.mode == "emulated" for r in ran), [(r.id, r.status) for r in suite.results]


def test_a_named_ep_dispatcher_that_takes_no_case_fails():
    suite = Suite.create("reference", "cpu", profile="quick")
    suite.run_ep(2, "reference.local")  # one device only: it declines process groups
    (failed,) = [r for r in suite.results if r.status == "fail"]
    assert failed.id == "ep/world2/reference.local" and "took none of the EP cases" in failed.detail


def test_the_cli_tries_each_of_the_backends_own_dispatchers_under_ep(tmp_path, capsys):
    """`--ep` without `--ep-dispatcher`: the generic dispatcher, then the backend's own. One that
    takes no case gives one declined line, not a failure (the user did not name it)."""
    from moehal_conformance.cli import main

    # -k selects the EP cases too: "any layout" names the two that HCCL's flat layout can take
    code = main(["--backend", "npu", "--emulate", "--quick", "-k", "any layout", "--ep", "2",
                 "--report", str(tmp_path / "npu")])  # fmt: skip
    import json

    cases = json.loads((tmp_path / "npu.json").read_text())["cases"]
    hccl = [c for c in cases if c["family"] == "ep" and "npu.hccl" in c["pipeline"]]
    assert code == 0 and {c["status"] for c in hccl} == {"pass"} and len(hccl) == 2
    local = [c for c in cases if c["id"].startswith("ep/world2/npu.local")]
    assert local and all(c["status"] == "declined" and "took none of the EP cases" in c["detail"] for c in local)
