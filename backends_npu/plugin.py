"""Entry point `npu` of group `moehal.backends`: the Ascend NPU backend.

Registers, as ordinary implementations: the torch_npu grouped-matmul experts (BF16, W8A8
INT8 dynamic), the two DeepEP-Ascend FuseEP fused forwards, the flat low-latency and HCCL
dispatchers, and their weight processors. Importing this module imports neither torch_npu
nor DeepEP-Ascend: availability is checked with `importlib.util.find_spec`, vendor modules
are imported inside the ops when they run.
"""

from __future__ import annotations

from collections.abc import Sequence

import moehal
from moehal.capability import Decision, accept, decline
from moehal.hardware import HardwareInfo, module_available, package_version
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, Dispatcher, Experts, FusedForward, WeightProcessor
from moehal.settings import Settings
from moehal_npu.common import BACKEND, EMULATE_SWITCH, EMULATED_REASON, torch_npu_missing
from moehal_npu.dispatch import HcclDispatcher, LocalFlatDispatcher
from moehal_npu.experts import GmmExperts
from moehal_npu.fuseep import DispatchFfnCombine, FusedDeepMoe
from moehal_npu.weights import DispatchFfnCombineWeights, FusedDeepMoeWeights, GmmWeights


def available(hw: HardwareInfo, settings: Settings | None = None) -> Decision:
    """Whether the backend can run here. Emulation counts only when switched on explicitly."""
    s = settings if settings is not None else Settings.from_env()
    if BACKEND in s.emulate:
        return accept(EMULATED_REASON)
    if not module_available("torch_npu"):
        return decline(f"{torch_npu_missing()}; or set {EMULATE_SWITCH} to emulate")
    if hw.kind != "npu":
        return decline(f"no Ascend NPU visible (the device is {hw.kind}); import torch_npu before building layers")
    return accept(f"Ascend NPU: {hw.name}")


def libraries() -> dict[str, str | None]:
    return {"torch-npu": package_version("torch-npu"), "deep_ep (DeepEP-Ascend)": package_version("deep_ep")}


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(
        name=BACKEND,
        version=moehal.__version__,
        description="Ascend NPU: torch_npu grouped matmuls, HCCL dispatch, DeepEP-Ascend FuseEP",
        available=available,
        libraries=libraries,
    )


@hookimpl
def moehal_dispatchers() -> Sequence[Dispatcher]:
    return [LocalFlatDispatcher(), HcclDispatcher()]


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    return [GmmExperts()]


@hookimpl
def moehal_fused_forwards() -> Sequence[FusedForward]:
    return [FusedDeepMoe(), DispatchFfnCombine()]


@hookimpl
def moehal_weight_processors() -> Sequence[WeightProcessor]:
    return [GmmWeights(), FusedDeepMoeWeights(), DispatchFfnCombineWeights()]
