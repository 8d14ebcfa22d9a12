"""Entry point `rocm` of group `moehal.backends`: AMD GPUs through ROCm.

Experts, best first: AMD AITER (priority 30, when `aiter` imports), the portable Triton fused
MoE shared with the CUDA backend (20), and a slow pure-torch fallback (1) so that no
configuration is left without a path. Token movement uses the reference dispatcher.

On a machine whose torch has no ROCm, nothing of this backend can run natively: the Triton
experts run only in the interpreter on CPU (TRITON_INTERPRET=1) and the fallback is the
reference math. There the plugin declares them BELOW the reference (Triton -1, fallback -2), so
that automatic selection never picks `rocm` on a CPU or NVIDIA machine (a test suite run with
TRITON_INTERPRET=1 would otherwise interpret every layer it builds); `backend='rocm'` still
gets the Triton kernels first, then the fallback. With ROCm: AITER 30, Triton 20, fallback 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import moehal
import torch
from moehal.capability import Decision, accept, decline
from moehal.hardware import HardwareInfo
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, Experts, WeightProcessor
from moehal_rocm import hw as rocm_hw
from moehal_rocm.aiter_experts import AiterExperts
from moehal_rocm.torch_experts import TorchFallbackExperts
from moehal_rocm.triton_experts import TritonExperts
from moehal_rocm.weights import AiterWeightProcessor, TritonWeightProcessor


def available(hw: HardwareInfo) -> Decision:
    hip = rocm_hw.rocm_build()
    if hip is None:
        if hw.kind == "cpu" and rocm_hw.interpreting():
            return accept("no ROCm, but TRITON_INTERPRET=1: the Triton kernels run in the interpreter (tests only)")
        return decline(
            "no ROCm: torch is a CUDA/CPU build (torch.version.hip is None); install a ROCm build of torch "
            "(https://pytorch.org/get-started/locally/) on a machine with an AMD GPU"
        )
    if hw.kind != "rocm":
        return decline(f"torch is a ROCm {hip} build but no AMD GPU is visible (device is {hw.kind})")
    if not rocm_hw.triton_available():
        return accept(f"ROCm {hip} on {hw.arch}; triton missing, so only the slow torch fallback runs")
    aiter = rocm_hw.aiter_version()
    return accept(f"ROCm {hip} on {hw.name} ({hw.arch}); Triton kernels; AITER {aiter or 'not installed'}")


def libraries() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "hip": rocm_hw.rocm_build(),
        "triton": rocm_hw.triton_version(),
        "aiter": rocm_hw.aiter_version(),
    }


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name="rocm",
        version=moehal.__version__,
        description="AMD GPUs (ROCm): AITER fused MoE, portable Triton fused MoE, slow torch fallback",
        available=available,
        libraries=libraries,
    )


def priorities(on_rocm: bool) -> tuple[int, int]:
    """(Triton, torch fallback) priorities; see the module docstring."""
    return (TritonExperts.priority, TorchFallbackExperts.priority) if on_rocm else (-1, -2)


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    triton_p, fallback_p = priorities(rocm_hw.rocm_build() is not None)
    return [AiterExperts(), TritonExperts(priority=triton_p), TorchFallbackExperts(priority=fallback_p)]


@hookimpl
def moehal_weight_processors() -> Sequence[WeightProcessor]:
    return [AiterWeightProcessor(), TritonWeightProcessor()]
