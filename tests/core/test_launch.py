"""`moehal.kernels.launch`: programmatic dependent launch is a timing choice, off wherever it
cannot run (CPU, the interpreter), and its mode is one of a closed set."""

from __future__ import annotations

import pytest
import torch

launch = pytest.importorskip("moehal.kernels.launch")


def test_pdl_is_off_on_cpu_in_every_mode() -> None:
    before = launch.mode()
    try:
        for mode in launch.MODES:
            launch.set_mode(mode)
            assert launch.pdl_args(torch.device("cpu")) == {"USE_PDL": False, "PDL_EARLY": False}
    finally:
        launch.set_mode(before)


def test_unknown_pdl_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="PDL mode"):
        launch.set_mode("sometimes")
