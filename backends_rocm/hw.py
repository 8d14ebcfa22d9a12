"""What the ROCm backend needs to know about the machine (no vendor imports)."""

from __future__ import annotations

import os

import torch
from moehal.hardware import HardwareInfo, module_available, package_version

# Architectures with FP8 matrix cores: MI300 (gfx940/941/942, e4m3fnuz), MI350 (gfx950) and
# RDNA4 (gfx12xx), both OCP e4m3fn.
FP8_ARCH_PREFIXES = ("gfx94", "gfx95", "gfx12")
AITER_ARCHS = ("gfx942", "gfx950")


def interpreting() -> bool:
    """Triton kernels run in the interpreter (TRITON_INTERPRET=1): CPU tensors, slow, exact."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def rocm_build() -> str | None:
    """The HIP version torch was built with, or None for CUDA/CPU builds."""
    return getattr(torch.version, "hip", None)


def fp8_capable(hw: HardwareInfo) -> bool:
    if hw.kind == "rocm":
        return hw.arch is not None and hw.arch.startswith(FP8_ARCH_PREFIXES)
    if hw.kind == "cuda":
        return (hw.sm or 0) >= 89
    return hw.kind == "cpu"  # the interpreter computes fp8 in software


def fp8_is_fnuz(hw: HardwareInfo) -> bool:
    """MI300 (gfx94x) computes with e4m3fnuz; everything else with OCP e4m3fn."""
    return hw.kind == "rocm" and hw.arch is not None and hw.arch.startswith("gfx94")


def triton_version() -> str | None:
    return package_version("triton") or package_version("pytorch-triton-rocm")


def triton_available() -> bool:
    return module_available("triton")


def aiter_version() -> str | None:
    return package_version("aiter") or package_version("amd-aiter")
