"""The portable Triton fused-MoE experts (`moehal.kernels.triton_fused_moe`).

One implementation for AMD and NVIDIA: the ROCm backend registers `TritonExperts()`
(devices {'rocm'}); the CUDA backend instantiates it with its own devices, e.g.
`TritonExperts(devices=frozenset({'cuda'}))`, or subclasses it, and registers a
`TritonWeightProcessor` of its own for the `triton_fused_moe` weight layout.

On CPU it runs only under TRITON_INTERPRET=1 (the Triton interpreter: the real kernel code,
exact but slow), reported as execution mode 'interpreted'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.config import Activation
from moehal.formats import ActivationFormat, Layout, ScaleKind, StandardInput, StandardOutput
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner
from moehal.quant import BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, W8A8_INT8, QuantKind, QuantScheme, ScaleFormat
from moehal_rocm import hw as rocm_hw
from moehal_rocm.weights import TRITON_LAYOUT, to_fnuz


class TritonExpertsRunner(ExpertsRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        from moehal.kernels import triton_fused_moe as kernel  # imports triton: only at build

        self.kernel = kernel
        self.fmt = fmt
        c = req.config
        self.config = c
        self.is_rocm = req.hardware.kind == "rocm"
        self.device_name = req.hardware.name if req.hardware.kind in ("rocm", "cuda") else None
        self.all_local = c.ep_size == 1
        self.w: Any = None

    def load(self, weights: Any) -> None:
        self.w = weights

    def apply(self, inp: Any) -> Any:
        assert self.w is not None, "weights not loaded"
        if not isinstance(inp, StandardInput):
            raise TypeError(f"Triton experts take StandardInput, not {type(inp).__name__}")
        c = self.config
        hidden, scales = inp.hidden, inp.scales
        if self.fmt.is_quantized:
            assert scales is not None
            if self.w.quant == "fp8_block" and self.w.fp8_dtype == torch.float8_e4m3fnuz:
                hidden, scales = to_fnuz(hidden, scales)  # dispatched as e4m3fn: reinterpret
        else:
            scales = None
        out = self.kernel.fused_moe(
            hidden,
            inp.topk_ids,
            inp.topk_weights,
            self.w,
            activation=c.activation.value,
            gated=c.gated,
            swiglu_alpha=c.swiglu_alpha,
            swiglu_limit=c.swiglu_limit,
            out_dtype=c.dtype,
            hidden_scales=scales,
            all_local=self.all_local,
            device_name=self.device_name,
            is_rocm=self.is_rocm,
        )
        return StandardOutput(out)


class TritonExperts(Experts):
    """Grouped GEMM over expert-sorted token blocks, gate/up and activation fused, in Triton."""

    name = "triton"
    priority = 20
    description = "portable Triton fused MoE: bf16/fp16/fp32, fp8 block scale (fnuz on MI300), int8 W8A8"
    devices: ClassVar[frozenset[str]] = frozenset({"rocm"})
    interpret_on_cpu: ClassVar[bool] = True  # also run on CPU when TRITON_INTERPRET=1
    quant_schemes: ClassVar[frozenset[QuantScheme]] = frozenset({BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, W8A8_INT8})
    activations: ClassVar[frozenset[Activation]] = frozenset(Activation)
    weight_layout: ClassVar[str] = TRITON_LAYOUT
    graph_capturable = True  # no host sync, static sizes (worst-case sorted length)
    deterministic = True  # no atomics: every output element is written by one program

    def __init__(self, devices: frozenset[str] | None = None, priority: int | None = None) -> None:
        if devices is not None:
            self.devices = frozenset(devices)  # type: ignore[misc]
        if priority is not None:
            self.priority = priority  # type: ignore[misc]

    def execution_mode(self, req: BuildRequest) -> str:
        return "interpreted" if req.hardware.kind == "cpu" else "native"

    def check_hardware(self, req: BuildRequest) -> Decision:
        kind = req.hardware.kind
        if kind == "cpu" and self.interpret_on_cpu:
            if rocm_hw.interpreting():
                return accept("CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1)", "hardware")
            return decline(
                "Triton needs a GPU; on CPU it runs only in the interpreter: set TRITON_INTERPRET=1 (slow, for tests)",
                "hardware",
            )
        return super().check_hardware(req)

    def check_libraries(self, req: BuildRequest) -> Decision:
        if not rocm_hw.triton_available():
            return decline(
                "triton is not installed: pip install 'moehal[rocm]' (ROCm torch wheels bring pytorch-triton-rocm)",
                "libraries",
            )
        return accept(predicate="libraries")

    def check_quant(self, req: BuildRequest) -> Decision:
        d = super().check_quant(req)
        if not d.ok:
            return d
        hw = req.hardware
        if req.quant.kind is QuantKind.FP8_BLOCK and not rocm_hw.fp8_capable(hw):
            where = hw.arch if hw.kind == "rocm" else (f"sm{hw.sm}" if hw.sm else hw.kind)
            return decline(
                f"fp8 needs FP8 matrix cores (MI300 gfx942, MI350 gfx950, RDNA4 gfx12, or NVIDIA SM89+); "
                f"this device is {where}: use bf16 or w8a8_int8",
                "quant",
            )
        return accept(predicate="quant")

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        dtype = req.config.dtype
        formats = [ActivationFormat(Layout.STANDARD, dtype)]  # quantized in Triton, one kernel
        q = req.quant
        if q.kind is QuantKind.FP8_BLOCK:
            kind = ScaleKind.GROUP_128_UE8M0 if q.scale_format is ScaleFormat.UE8M0 else ScaleKind.GROUP_128
            formats.append(ActivationFormat(Layout.STANDARD, torch.float8_e4m3fn, kind))
        elif q.kind is QuantKind.W8A8_INT8:
            formats.append(ActivationFormat(Layout.STANDARD, torch.int8, ScaleKind.PER_TOKEN))
        return formats

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return TritonExpertsRunner(req, fmt)
