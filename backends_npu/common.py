"""What every NPU implementation shares: the emulation switch, the hardware and library
checks, the dtype rule, and the plugin-defined flat low-latency layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moehal.capability import Decision, accept, decline
from moehal.hardware import module_available
from moehal.interfaces import BuildRequest, Implementation
from moehal_npu.ops import VendorOps

BACKEND = "npu"
EMULATE_SWITCH = "MOEHAL_EMULATE=npu"  # (MOEHAL_NPU_EMULATE=1 is its deprecated alias)
EMULATED_REASON = f"emulated mode ({EMULATE_SWITCH}): vendor ops run as torch stand-ins"


def torch_npu_install() -> str:
    """The command that installs the torch_npu release matching this torch. Each torch-npu
    release pins the torch of its number (torch-npu 2.14.0: `torch==2.14.0.*`), so a plain
    `pip install torch-npu`, or a `torch-npu>=...` extra, installs the newest one and replaces
    the user's torch with its own. `.*`: the release's newest post-fix (2.12.0.post3 for torch
    2.12.0), each of which pins the same torch."""
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(torch.__version__).base_version  # 2.13.0+cpu, 2.14.0.dev20260101: the release
    except InvalidVersion:
        version = torch.__version__.split("+")[0]
    return f'pip install "torch-npu=={version}.*"'


def torch_npu_missing() -> str:
    """Why the native backend cannot run here when torch_npu is not installed, and the fix."""
    return (
        f"torch_npu is not installed: {torch_npu_install()} (the release for this torch, {torch.__version__}; "
        "each torch-npu release pins its own torch and would replace this one)"
    )


# DeepEP-Ascend's low-latency dispatch (and npu_moe_distribute_dispatch, npu_moe_init_routing_v2)
# return a flat 2-D, expert-sorted layout with one fp32 scale per row, not CUDA DeepEP's
# 3-D [E_local, max_m, H]. The NPU plugin declares it; the core knows nothing about it.
NPU_LL_FLAT = "npu_ll_flat"


@dataclass(frozen=True, slots=True)
class FlatInput:
    """The `npu_ll_flat` layout. hidden `[M, H]` expert-sorted rows (bf16, or int8 with
    scales fp32 `[M]` per row); group_list int64 `[E_local]`: rows per local expert as
    cumulative ends (group_list_type 0) or counts (1), whichever the producing op returned.
    M is static (the op's receive bound); rows past the last group end are padding."""

    hidden: torch.Tensor
    scales: torch.Tensor | None
    group_list: torch.Tensor
    group_list_type: int


@dataclass(frozen=True, slots=True)
class FlatOutput:
    """`[M, H]` in the layer dtype: one unweighted row per dispatched row; padding rows zero."""

    hidden: torch.Tensor


def ascend_generation(name: str) -> str | None:
    """The Atlas generation of an Ascend device name: 'A3' (Ascend910_93xx), 'A2' (Ascend910B*),
    else None. Some vendor ops' limits differ between them."""
    n = name.replace(" ", "")
    if "910_93" in n:
        return "A3"
    if "910B" in n:
        return "A2"
    return None


def vendor_ops(req: BuildRequest) -> VendorOps:
    return VendorOps(emulate=req.emulating(BACKEND))


class NpuImplementation(Implementation):
    """Mixin for every NPU implementation (put it first in the bases)."""

    devices = frozenset({"npu"})
    extra_libraries: tuple[tuple[str, str], ...] = ()  # (module, how to install) beyond torch_npu

    def execution_mode(self, req: BuildRequest) -> str:
        return "emulated" if req.emulating(BACKEND) else "native"

    def check_hardware(self, req: BuildRequest) -> Decision:
        if req.emulating(BACKEND):
            return accept(f"{EMULATED_REASON} on {req.hardware.kind}", "hardware")
        if req.hardware.kind != "npu":
            return decline(
                f"runs on Ascend NPUs, not {req.hardware.kind}; to run its vendor-op orchestration here with "
                f"torch stand-ins (reported as emulated), set {EMULATE_SWITCH}",
                "hardware",
            )
        return accept(predicate="hardware")

    def check_libraries(self, req: BuildRequest) -> Decision:
        if req.emulating(BACKEND):
            return accept(EMULATED_REASON, "libraries")
        if not module_available("torch_npu"):
            return decline(torch_npu_missing(), "libraries")
        for module, how in self.extra_libraries:
            if not module_available(module):
                return decline(f"{module} is not installed ({how})", "libraries")
        return accept(predicate="libraries")

    def check_dtype(self, req: BuildRequest) -> Decision:
        dt = req.config.dtype
        if dt == torch.float16:
            return decline(
                "Ascend dispatch/combine do not support FP16 (DeepEP-Ascend and npu_moe_distribute_dispatch/"
                "combine take BF16 activations); build the layer with dtype=torch.bfloat16",
                "quant",
            )
        if dt != torch.bfloat16:
            return decline(f"the Ascend MoE path runs BF16 activations, not {dt}; use dtype=torch.bfloat16", "quant")
        return accept(predicate="quant")

    def check_quant(self, req: BuildRequest) -> Decision:
        d = self.check_dtype(req)
        return d if not d.ok else super().check_quant(req)
