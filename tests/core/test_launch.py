"""Programmatic dependent launch is decided per device and never on CPUs or the interpreter."""

from __future__ import annotations

import torch
from moehal.kernels import launch


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert launch.pdl_args(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.enabled(torch.device("cuda", 0))  # the interpreter runs no GPU launches


def test_set_enabled_forbids_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_supported", lambda index: True)
    try:
        assert launch.pdl_args(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
        launch.set_enabled(False)
        assert launch.pdl_args(torch.device("cuda", 0)) == {"USE_PDL": False}
    finally:
        launch.set_enabled(True)
