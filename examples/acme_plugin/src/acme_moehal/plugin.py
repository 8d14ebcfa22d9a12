"""Entry point `acme` of group `moehal.backends`: the hooks moehal calls once, at discovery."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from moehal import BackendInfo, Decision, Experts, HardwareInfo, accept, decline, hookimpl

import acme_moehal
from acme_moehal.experts import AcmeExperts


def _available(hw: HardwareInfo) -> Decision:
    if hw.kind in AcmeExperts.devices:
        return accept(f"runs on {hw.kind} with plain torch")
    return decline(f"acme runs on {sorted(AcmeExperts.devices)}, this machine is {hw.kind}")


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name="acme",
        version=acme_moehal.__version__,
        description="example backend: dense pure-torch experts (gated SiLU, standard layout)",
        available=_available,
        libraries=lambda: {"torch": torch.__version__},
    )


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    # No dispatcher: acme's experts consume the core STANDARD layout, which moehal's reference
    # dispatcher produces on any device. A vendor with its own token movement would also
    # implement moehal_dispatchers().
    return [AcmeExperts()]
