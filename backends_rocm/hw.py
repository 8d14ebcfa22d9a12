"""What the ROCm backend needs to know about the machine (no vendor imports)."""

from __future__ import annotations

import torch
from moehal.hardware import module_available, package_version
from moehal.kernels.triton_experts import fp8_capable, fp8_is_fnuz, interpreting, triton_available

__all__ = [
    "AITER_ARCHS",
    "aiter_version",
    "fp8_capable",
    "fp8_is_fnuz",
    "interpreting",
    "module_available",
    "rocm_build",
    "triton_available",
    "triton_version",
]

AITER_ARCHS = ("gfx942", "gfx950")


def rocm_build() -> str | None:
    """The HIP version torch was built with, or None for CUDA/CPU builds."""
    return getattr(torch.version, "hip", None)


def triton_version() -> str | None:
    return package_version("triton") or package_version("pytorch-triton-rocm")


def aiter_version() -> str | None:
    """AMD AITER's version. Its distribution is `amd-aiter`; `aiter` on PyPI is an unrelated
    package, so that name is only a fallback for source builds that register as it."""
    return package_version("amd-aiter") or package_version("aiter")
