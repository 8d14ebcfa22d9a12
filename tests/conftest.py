"""Shared fixtures: small random MoE problems."""

from __future__ import annotations

import os

import moehal
import pytest
import torch


def pytest_report_header(config):
    return [
        f"moehal {moehal.__version__}, torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    ]


@pytest.fixture
def registry():
    """A fresh registry loaded from the installed entry points, environment ignored."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    return reg
