"""The portable Triton fused-MoE experts and their weight processor, shared by backends.

One implementation for AMD and NVIDIA (the kernels: `moehal.kernels.triton_fused_moe`). The
ROCm backend registers `TritonExperts()` (devices {'rocm'}, and the CPU under the Triton
interpreter, for tests); the CUDA backend subclasses it with devices {'cuda'}. Each backend
registers its own `TritonWeightProcessor` for the `triton_fused_moe` weight layout, so neither
depends on the other being installed.

On CPU it runs only under TRITON_INTERPRET=1 (the Triton interpreter: the real kernel code,
exact but slow), reported as execution mode 'interpreted'. Importing this module never
imports triton.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from moehal.capability import Decision, accept, decline
from moehal.config import Activation
from moehal.errors import WeightError
from moehal.formats import ActivationFormat, Layout, ScaleKind, StandardInput, StandardOutput
from moehal.hardware import HardwareInfo, module_available
from moehal.interfaces import BuildRequest, Experts, ExpertsRunner, TunedShape, WeightProcessor
from moehal.kernels.host import (
    interpreter_mode_changed,
    interpreter_too_old,
    interpreting,
    kernels_interpreted,
    mode_change_reason,
)
from moehal.quant import BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_TENSOR, W8A8_INT8, QuantKind, QuantScheme, ScaleFormat
from moehal.weights import ExpertWeights

TRITON_LAYOUT = "triton_fused_moe"
_KERNEL_QUANT = {
    QuantKind.BF16: "none",
    QuantKind.FP8_BLOCK: "fp8_block",
    QuantKind.FP8_TENSOR: "fp8_tensor",
    QuantKind.W8A8_INT8: "int8",
}
_SCHEMES = frozenset({BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_TENSOR, W8A8_INT8})
_FP8 = (QuantKind.FP8_BLOCK, QuantKind.FP8_TENSOR)
# Token counts up to this keep their bound launches (`bind_fused_moe`, one per count): at these
# sizes an eager forward's host time is mostly argument preparation, and it can exceed the
# GPU's time. Larger batches bind at every call, so a stream of prefill sizes keeps nothing.
KEEP_BOUND_TOKENS = 1024


def triton_available() -> bool:
    return module_available("triton")


# Architectures with FP8 matrix cores: MI300 (gfx940/941/942, e4m3fnuz), MI350 (gfx950) and
# RDNA4 (gfx12xx), both OCP e4m3fn.
FP8_ARCH_PREFIXES = ("gfx94", "gfx95", "gfx12")


def fp8_capable(hw: HardwareInfo) -> bool:
    if hw.kind == "rocm":
        return hw.arch is not None and hw.arch.startswith(FP8_ARCH_PREFIXES)
    if hw.kind == "cuda":
        return (hw.sm or 0) >= 89
    return hw.kind == "cpu"  # the interpreter computes fp8 in software


def fp8_is_fnuz(hw: HardwareInfo) -> bool:
    """MI300 (gfx94x) computes with e4m3fnuz; everything else with OCP e4m3fn."""
    return hw.kind == "rocm" and hw.arch is not None and hw.arch.startswith("gfx94")


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.float().contiguous() if t is not None else None


def to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn weights -> e4m3fnuz for MI300 (same bits, scale x2, -0 -> +0); lossless for every
    finite pattern (fn's NaN patterns read as +-240, as vLLM's normalization leaves them).
    The vLLM/SGLang ROCm paths normalize checkpoints the same way."""
    bits = q.view(torch.int8)
    bits = bits.masked_fill(bits == -128, 0)  # (a mask and the result: no third full-size tensor)
    return bits.view(torch.float8_e4m3fnuz).contiguous(), (scale.float() * 2.0).contiguous()


class TritonWeightProcessor(WeightProcessor):
    """Canonical weights -> `moehal.kernels.triton_fused_moe.TritonMoEWeights`.

    The kernel reads the canonical `[E, N, K]` layout; this interleaves an unquantized gated
    w13's gate and up rows (`pair_gate_up`: one GEMM1 dot per K step instead of two), converts
    fp8 to the hardware's flavour (e4m3fnuz on MI300; per-tensor fp8's static activation
    scales double with the weights') and biases to fp32. The CUDA backend registers its
    own instance (`TritonWeightProcessor(devices=frozenset({'cuda'}))`) so that its Triton
    experts do not depend on this plugin being loaded.
    """

    name = "triton_weights"
    layout = TRITON_LAYOUT
    priority = 20
    description = "canonical -> Triton fused-MoE weights (fp8 e4m3fn -> e4m3fnuz on MI300)"
    devices: ClassVar[frozenset[str]] = frozenset({"rocm", "cpu"})
    quant_schemes: ClassVar[frozenset[QuantScheme]] = _SCHEMES

    def __init__(self, devices: frozenset[str] | None = None) -> None:
        if devices is not None:
            self.devices = frozenset(devices)  # type: ignore[misc]

    def process(self, weights: ExpertWeights, req: BuildRequest) -> Any:
        from moehal.kernels.triton_fused_moe import TritonMoEWeights, pair_gate_up

        kind = req.quant.kind
        w13, w2, s13, s2 = weights.w13, weights.w2, weights.w13_scale, weights.w2_scale
        a13, a2 = _fp32(weights.a13_scale), _fp32(weights.a2_scale)
        if kind is QuantKind.FP8_TENSOR:
            if a13 is None or a2 is None:
                raise WeightError("fp8_tensor weights need their static activation scales a13_scale and a2_scale")
            a13, a2 = a13.reshape(1), a2.reshape(1)
        if kind in _FP8 and fp8_is_fnuz(req.hardware):
            assert s13 is not None and s2 is not None
            w13, s13 = to_fnuz(w13, s13)
            w2, s2 = to_fnuz(w2, s2)
            if kind is QuantKind.FP8_TENSOR:  # activations quantized to the fnuz grid: scale x2 too
                a13, a2 = a13 * 2.0, a2 * 2.0
        # Unquantized gated w13: gate and up rows interleaved, so GEMM1 runs one dot per K step.
        paired = kind is QuantKind.BF16 and req.config.gated
        return TritonMoEWeights(
            w13=pair_gate_up(w13) if paired else w13.contiguous(),
            w2=w2.contiguous(),
            quant=_KERNEL_QUANT[kind],
            w13_scale=_fp32(s13),
            w2_scale=_fp32(s2),
            w13_bias=_fp32(weights.w13_bias),
            w2_bias=_fp32(weights.w2_bias),
            ue8m0=req.quant.scale_format is ScaleFormat.UE8M0,
            w13_paired=paired,
            a13_scale=a13 if kind is QuantKind.FP8_TENSOR else None,
            a2_scale=a2 if kind is QuantKind.FP8_TENSOR else None,
        )


def portable_tiles(req: BuildRequest) -> Callable[[int], tuple[Any, Any]]:
    """tokens -> the (GEMM1, GEMM2) tiles the portable fused MoE runs a batch of that size with
    for `req` on its device (`triton_fused_moe.select_configs`: the device's tuned table, else
    the heuristic)."""
    from moehal.kernels import triton_fused_moe as kernel

    c, hw = req.config, req.hardware
    quant = _KERNEL_QUANT[req.quant.kind]
    dname = kernel._DTYPE_NAMES.get(c.dtype, "bf16")
    dev = hw.name if hw.kind in ("rocm", "cuda") else None
    e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    return lambda t: kernel.select_configs(t, e, h, i, c.top_k, quant, dname, dev, hw.kind == "rocm")


class TritonExpertsRunner(ExpertsRunner):
    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        from moehal.kernels import triton_fused_moe as kernel  # imports triton: only at build

        self.kernel = kernel
        self.fmt = fmt
        c = req.config
        self.config = c
        self.is_rocm = req.hardware.kind == "rocm"
        self.device_name = req.hardware.name if req.hardware.kind in ("rocm", "cuda") else None
        # no -1 ids: one device and no padding slots (the kernel then lets top-1 GEMM2 write the
        # output rows itself, and nothing would write a padded token's row)
        self.all_local = c.ep_size == 1 and not c.topk_padding
        self.w: Any = None
        self._bound: dict[int, Any] = {}  # token count -> its `BoundFusedMoE` on these weights
        self._tables = kernel.TABLES_VERSION

    def __getstate__(self) -> dict[str, Any]:
        # a copy (of a layer on the CPU, `MoELayer.__getstate__`) binds its own launches, on
        # its copy of the weights, and imports the kernel module again
        state = self.__dict__.copy()
        del state["kernel"]
        state["_bound"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from moehal.kernels import triton_fused_moe as kernel

        self.__dict__.update(state, kernel=kernel)

    def load(self, weights: Any) -> None:
        self.w = weights
        self._bound.clear()  # they hold the previous weights (and their TMA descriptors)

    def apply(self, inp: Any) -> Any:
        return self._apply(inp, None)

    def apply_into(self, inp: Any, out: torch.Tensor) -> Any:
        return self._apply(inp, out)  # the last kernel writes the weighted sum into `out`

    def _apply(self, inp: Any, out: torch.Tensor | None) -> Any:
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
        t = hidden.shape[0]
        if self._tables != self.kernel.TABLES_VERSION:  # tuned tables registered since: tiles may differ
            self._bound.clear()
            self._tables = self.kernel.TABLES_VERSION
        bound = self._bound.get(t)
        if bound is None:
            bound = self.kernel.bind_fused_moe(
                t, inp.topk_ids.shape[1], self.w, activation=c.activation.value, gated=c.gated,
                swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit, out_dtype=c.dtype,
                hidden_dtype=hidden.dtype, quantized_input=scales is not None, all_local=self.all_local,
                device_name=self.device_name, is_rocm=self.is_rocm,
            )  # fmt: skip
            if t <= KEEP_BOUND_TOKENS:
                self._bound[t] = bound
        y = bound(hidden, inp.topk_ids, inp.topk_weights, scales, out)
        return StandardOutput(y)


class TritonExperts(Experts):
    """Grouped GEMM over expert-sorted token blocks, gate/up and activation fused, in Triton."""

    name = "triton"
    priority = 20
    description = "portable Triton fused MoE: bf16/fp16/fp32, fp8 block scale and per tensor (fnuz on MI300), int8 W8A8"
    devices: ClassVar[frozenset[str]] = frozenset({"rocm"})
    interpret_on_cpu: ClassVar[bool] = True  # also run on CPU when TRITON_INTERPRET=1
    quant_schemes: ClassVar[frozenset[QuantScheme]] = _SCHEMES
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
        return "interpreted" if req.hardware.kind == "cpu" or kernels_interpreted() else "native"

    def check_hardware(self, req: BuildRequest) -> Decision:
        kind = req.hardware.kind
        if interpreter_mode_changed():
            return decline(mode_change_reason(), "hardware")
        if kind == "cpu" and self.interpret_on_cpu:
            if interpreting():
                old = interpreter_too_old()
                if old is not None:
                    return decline(old, "hardware")
                return accept("CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1)", "hardware")
            return decline(
                "Triton needs a GPU; on CPU it runs only in the interpreter: set TRITON_INTERPRET=1 (slow, for tests)",
                "hardware",
            )
        return super().check_hardware(req)

    def check_libraries(self, req: BuildRequest) -> Decision:
        if not triton_available():
            return decline(
                "triton is not installed: pip install 'moehal[cuda]' or 'moehal[rocm]' "
                "(ROCm torch wheels bring pytorch-triton-rocm)",
                "libraries",
            )
        return accept(predicate="libraries")

    def check_quant(self, req: BuildRequest) -> Decision:
        d = super().check_quant(req)
        if not d.ok:
            return d
        hw = req.hardware
        if req.quant.kind in _FP8 and not fp8_capable(hw):
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

    def tuned_shapes(self, req: BuildRequest) -> Sequence[TunedShape]:
        """The benchmark's model shapes (`moehal.bench.SHAPES`) for which this device has a
        tuned table entry (`triton_fused_moe.has_tuned_entry`), per scheme this device runs,
        each with the smallest batch size of every distinct pair of tiles up to
        `moehal.bench.TUNED_MAX_TOKENS` tokens."""
        if req.hardware.kind not in ("cuda", "rocm"):
            return ()
        from moehal.bench import model_requests  # the shapes the tables are tuned for
        from moehal.kernels import triton_fused_moe as kernel

        out: list[TunedShape] = []
        for name, r in model_requests(self, req):
            c, kq = r.config, _KERNEL_QUANT[r.quant.kind]
            dtype = "bf16" if kq == "none" else kq
            key = kernel.table_key(c.num_local_experts, c.hidden_size, c.intermediate_size, dtype)
            if kernel.has_tuned_entry(req.hardware.name, key):
                why = f"the tiles of the tuned table of {req.hardware.name}"
                out.append(TunedShape.covering(name, c, r.quant, portable_tiles(r), why))
        return out

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return TritonExpertsRunner(req, fmt)
