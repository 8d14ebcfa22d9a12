"""The `moehal` command line."""

from __future__ import annotations

import json
import subprocess
import sys

import moehal
import pytest
import torch
from moehal.cli import common
from moehal.cli.main import main


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setattr(common.console, "width", 250)  # no wrapping inside the strings we look for


def test_doctor_json_lists_reference_available_and_others_with_reason():
    out = subprocess.run(
        [sys.executable, "-m", "moehal.cli.main", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=None,
    ).stdout
    report = json.loads(out)
    by_name = {b["name"]: b for b in report["backends"]}
    assert by_name["reference"]["available"] is True
    for name in ("cuda", "npu", "rocm"):
        assert name in by_name
        b = by_name[name]
        assert b["reason"], f"{name} must say why it is (un)available"
        if name != "cuda" or not torch.cuda.is_available():  # a GPU machine has cuda
            assert b["available"] is False, f"{name} is available on this machine?"
    assert report["hardware"]["kind"] == ("cuda" if torch.cuda.is_available() else "cpu")
    ref = {c["name"]: c for c in by_name["reference"]["components"]}
    assert ref["reference.experts"]["kind"] == "experts" and ref["reference.experts"]["runs_here"] is True
    assert ref["reference.local"]["kind"] == "dispatcher"
    npu = by_name["npu"]["components"]
    assert npu and all(not c["runs_here"] and c["reason"] for c in npu)  # no NPU here: each says why


def test_doctor_table(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "Backends" in out
    assert "Components of the available backends" in out and "reference.experts" in out


def test_explain_shows_decisions_and_plan(capsys):
    assert main(["explain", "--experts", "8", "--hidden", "256", "--intermediate", "128", "--quant", "fp8_block"]) == 0
    out = capsys.readouterr().out
    assert "reference.experts" in out and "moehal plan" in out and "masked[float8_e4m3fn+group128]" in out


def test_explain_json_and_no_pipeline_exit_code(capsys):
    assert (
        main(
            [
                "explain",
                "--json",
                "--hidden",
                "256",
                "--intermediate",
                "128",
                "--backend",
                "reference",
                "--layout",
                "masked",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["format"].startswith("masked")
    assert main(["explain", "--layout", "no_such_layout", "--hidden", "256", "--intermediate", "128"]) == 1
    assert "No pipeline" in capsys.readouterr().out


def test_explain_shows_which_dispatchers_drop_padding_ids(capsys, monkeypatch):
    monkeypatch.setenv("MOEHAL_NPU_EMULATE", "1")  # the NPU dispatchers, which do not declare it
    reg = moehal.Registry(moehal.Settings.from_env())
    reg.load_entry_points()
    monkeypatch.setattr(moehal.plugins, "_default", reg)  # what `moehal.discover()` returns here
    args = ["explain", "--json", "--hidden", "512", "--intermediate", "512", "--backend", "npu", "--topk-padding"]
    args += ["--device", "cpu"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert "-1 ids" in data["config"]
    declined = {d["name"]: d["reason"] for d in data["decisions"] if d["predicate"] == "padding_ids" and not d["ok"]}
    assert "npu.local_flat" in declined and "drops_padding_ids" in declined["npu.local_flat"], declined
    assert data["chosen"]["dispatcher"] == "reference.local", data["chosen"]


def test_explain_rejects_an_invalid_config(capsys):
    assert main(["explain", "--top-k", "9", "--experts", "4"]) == 2
    assert "exceeds num_experts" in capsys.readouterr().out


def test_explain_backend_auto_means_any_and_a_misspelt_one_is_named(capsys):
    """`--backend auto` means no restriction, as `MoELayer(backend="auto")` does (it declined
    every candidate as "not of the requested backend 'auto'"); an unknown name is the unknown-
    backend error with the loaded backends, not a table of declines."""
    args = ["explain", "--experts", "8", "--hidden", "256", "--intermediate", "128", "--device", "cpu"]
    assert main([*args, "--backend", "auto"]) == 0
    assert "moehal plan" in capsys.readouterr().out
    assert main([*args, "--backend", "refrence"]) == 2
    out = capsys.readouterr().out
    assert "unknown backend 'refrence'" in out and "reference" in out


def test_list(capsys):
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"reference.local", "reference.experts"} <= {r["name"] for r in rows}
