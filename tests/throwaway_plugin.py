"""A throwaway backend for the conformance suite's own tests: the implementations a test defines,
registered as a plugin beside the installed ones, and a quick conformance run of it on the CPU."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import moehal
import torch
from moehal_conformance.suite import Suite


def throwaway_suite(
    name: str, experts: Sequence[Any] = (), dispatchers: Sequence[Any] = (), *, poison: bool = True
) -> Suite:
    """A `quick` Suite on the CPU of backend `name`, made of `experts` and `dispatchers`."""
    plugin = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: moehal.BackendInfo(name, "9.9", "throwaway")),
        moehal_experts=moehal.hookimpl(lambda: list(experts)),
    )
    if dispatchers:
        plugin.moehal_dispatchers = moehal.hookimpl(lambda: list(dispatchers))
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    assert reg.register(plugin, name).status == "loaded"
    return Suite(name, reg, torch.device("cpu"), profile="quick", poison=poison)
