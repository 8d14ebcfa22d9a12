"""CUDA backend tests. Without a GPU the Triton kernels run under the interpreter
(TRITON_INTERPRET=1 must be set before triton decorates the kernels, so it is set here)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _verify_fast_launches(monkeypatch):
    """On a GPU every fast Triton launch in these tests is checked against the compiled kernel
    Triton itself would pick (`moehal.kernels.launch.VERIFY`); a difference raises."""
    if torch.cuda.is_available():
        from moehal.kernels import launch

        monkeypatch.setattr(launch, "VERIFY", True)
