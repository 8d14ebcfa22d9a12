"""Entry point `cuda`. STUB: this backend registers no implementations yet; `moehal doctor`
says so. It exists so that the entry point, packaging and discovery are exercised."""

from __future__ import annotations

import moehal
from moehal.capability import decline
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name="cuda",
        version=moehal.__version__,
        description="CUDA backend (stub: no kernels registered yet)",
        available=lambda hw: decline("stub: no kernels are registered by this backend yet"),
    )
