"""Fixtures for the NPU backend tests: an emulating registry and small problems."""

from __future__ import annotations

import moehal
import pytest


@pytest.fixture
def npu_registry():
    """Plugins from the entry points, with the NPU backend's emulation switched on explicitly."""
    reg = moehal.Registry(moehal.Settings(emulate=frozenset({"npu"})))
    reg.load_entry_points()
    return reg


@pytest.fixture
def plain_registry():
    """Plugins from the entry points, no emulation (what a CPU host without the switch sees)."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    return reg
