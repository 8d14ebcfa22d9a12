"""Entry point `reference` of group `moehal.backends`."""

from __future__ import annotations

from collections.abc import Sequence

import moehal
import torch
from moehal.capability import accept
from moehal.ep_dispatcher import TorchDistributedDispatcher
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, Dispatcher, Experts
from moehal.reference.dispatcher import ReferenceDispatcher
from moehal.reference.experts import ReferenceExperts


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name="reference",
        version=moehal.__version__,
        description="pure torch, any device: the oracle and the fallback",
        available=lambda hw: accept(f"pure torch runs on {hw.kind}"),
        libraries=lambda: {"torch": torch.__version__},
    )


@hookimpl
def moehal_dispatchers() -> Sequence[Dispatcher]:
    return [ReferenceDispatcher(), TorchDistributedDispatcher()]


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    return [ReferenceExperts()]
