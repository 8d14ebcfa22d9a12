"""Entry point `cuda` of group `moehal.backends`: NVIDIA kernels (DeepGEMM, FlashInfer, DeepEP)
with Triton glue. Declaring never imports a vendor library; checks import lazily."""

from __future__ import annotations

from collections.abc import Sequence

import moehal
import torch
from moehal.capability import Decision, accept, decline
from moehal.hardware import HardwareInfo, package_version
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, Dispatcher, Experts, FusedForward, WeightProcessor

# The portable Triton fused MoE (moehal.kernels) is one implementation shared with the ROCm
# backend. Here it runs on NVIDIA GPUs, below DeepGEMM (priority 20): it covers what DeepGEMM
# declines (e.g. shapes, int8, sm80/89).
from moehal.kernels.triton_experts import TritonExperts, TritonWeightProcessor
from moehal_cuda.deepgemm_experts import DeepGemmExperts, DeepGemmWeightProcessor
from moehal_cuda.dispatch import CudaPermuteDispatcher
from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts, Nvfp4DequantProcessor


class CudaTritonExperts(TritonExperts):
    devices = frozenset({"cuda"})
    interpret_on_cpu = False  # on CPU the interpreter path belongs to backend 'rocm' (tests)
    priority = 12


def _available(hw: HardwareInfo) -> Decision:
    if hw.kind != "cuda":
        return decline(f"no CUDA device (this device is {hw.kind})")
    return accept(f"{hw.name} sm{hw.sm}")


def _libraries() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "deep_gemm": package_version("sgl-deep-gemm") or package_version("deep-gemm"),
        "flashinfer": package_version("flashinfer-python") or package_version("flashinfer"),
        "deep_ep": package_version("sgl-deep-ep") or package_version("deep-ep") or package_version("deep_ep"),
    }


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name="cuda",
        version=moehal.__version__,
        description="NVIDIA: DeepGEMM grouped GEMMs, FlashInfer TRT-LLM / CuteDSL MoE, DeepEP, Triton glue",
        available=_available,
        libraries=_libraries,
    )


@hookimpl
def moehal_dispatchers() -> Sequence[Dispatcher]:
    from moehal_cuda.deepep import DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher

    return [CudaPermuteDispatcher(), DeepEPNormalDispatcher(), DeepEPLowLatencyDispatcher()]


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    from moehal_cuda.flashinfer_moe import CuteDslNvfp4Experts

    return [DeepGemmExperts(), Nvfp4DequantExperts(), CudaTritonExperts(), *CuteDslNvfp4Experts.variants()]


@hookimpl
def moehal_fused_forwards() -> Sequence[FusedForward]:
    from moehal_cuda.flashinfer_moe import TrtllmFp8BlockMoE, TrtllmFp8TensorMoE

    return [TrtllmFp8BlockMoE(), TrtllmFp8TensorMoE()]


@hookimpl
def moehal_weight_processors() -> Sequence[WeightProcessor]:
    from moehal_cuda.flashinfer_moe import flashinfer_weight_processors

    return [
        DeepGemmWeightProcessor(),
        Nvfp4DequantProcessor(),
        TritonWeightProcessor(devices=frozenset({"cuda"})),
        *flashinfer_weight_processors(),
    ]
