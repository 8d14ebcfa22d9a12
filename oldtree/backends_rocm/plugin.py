"""Entry point `rocm` of group `moehal.backends`: AMD GPUs through ROCm.

Experts, best first: AMD AITER (priority 30, when `aiter` imports), the portable Triton fused
MoE shared with the CUDA backend (20), and a slow pure-torch fallback (0, tied with the
reference, which wins the tie by name) so that `backend='rocm'` leaves no configuration
without a path. Token movement uses the reference dispatcher.

On a machine whose torch has no ROCm the Triton experts run only in the interpreter on CPU
(TRITON_INTERPRET=1, execution mode 'interpreted'), and automatic selection never picks an
interpreted pipeline: only `backend='rocm'` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import moehal
import torch
from moehal.capability import Decision, accept, decline
from moehal.hardware import HardwareInfo
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, Experts, WeightProcessor
from moehal.kernels.triton_experts import TritonExperts, TritonWeightProcessor
from moehal_rocm import hw as rocm_hw
from moehal_rocm.aiter_experts import AiterExperts
from moehal_rocm.torch_experts import TorchFallbackExperts
from moehal_rocm.weights import AiterWeightProcessor


def available(hw: HardwareInfo) -> Decision:
    hip = rocm_hw.rocm_build()
    if hip is None:
        # Availability means native execution; the interpreter is a test mode, named in the reason.
        interp = (
            " (TRITON_INTERPRET=1 is set: `backend='rocm'` runs its Triton kernels interpreted, for tests)"
            if hw.kind == "cpu" and rocm_hw.interpreting()
            else ""
        )
        return decline(
            "no ROCm: torch is a CUDA/CPU build (torch.version.hip is None); install a ROCm build of torch "
            "(https://pytorch.org/get-started/locally/) on a machine with an AMD GPU" + interp
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


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    return [AiterExperts(), TritonExperts(), TorchFallbackExperts()]


@hookimpl
def moehal_weight_processors() -> Sequence[WeightProcessor]:
    return [AiterWeightProcessor(), TritonWeightProcessor()]
