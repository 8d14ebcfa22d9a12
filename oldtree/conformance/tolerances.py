"""Tolerances per quant scheme, and the one comparison every conformance case uses.

Both sides start from the *same* quantized weights, so differences come from kernel
arithmetic (accumulation order, tf32/bf16 intermediates) and from quantization boundaries
that flip when intermediates round differently. Metrics, on the whole `[T, H]` output:

- rel_l2  = ||out - ref||_2 / ||ref||_2
- rel_max = max|out - ref| / max|ref|

NaN or Inf in the output always fails (FlashInfer's tests reject them first, too).

Where the numbers come from (see docs/conformance.md):
- bf16: torch.testing's bf16 rtol is 1.6e-2; vLLM's MoE tests use atol 2e-2 on outputs of
  order 0.1-1. Kernels keep GEMM1 and activation outputs in bf16, so rel_max gets 4e-2.
- fp16: fp16 epsilon is 8x smaller than bf16's.
- fp32: kernels may use tf32 tensor cores (10-bit mantissa), so 2e-3, not float32 epsilon.
- fp8_block, fp8_tensor: vLLM test_block_fp8 uses atol = rtol = 0.035.
- w8a8_int8: vLLM test_block_int8 uses 0.065; SGLang's int8 test mean-relative 0.05.
- nvfp4: vLLM's CUTLASS NVFP4 MoE test uses 0.1 (CuteDSL 0.2); we take 0.1 on rel_l2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moehal.quant import QuantKind, QuantScheme


@dataclass(frozen=True, slots=True)
class Tolerance:
    rel_l2: float
    rel_max: float
    source: str


_UNQUANTIZED = {
    torch.bfloat16: Tolerance(1.6e-2, 4e-2, "torch bf16 rtol 1.6e-2; vLLM MoE atol 2e-2"),
    torch.float16: Tolerance(4e-3, 1e-2, "fp16 epsilon 8x below bf16"),
    torch.float32: Tolerance(2e-3, 5e-3, "tf32 tensor cores allowed"),
}
_QUANTIZED = {
    QuantKind.FP8_BLOCK: Tolerance(0.035, 0.25, "vLLM test_block_fp8 atol=rtol=0.035"),
    QuantKind.FP8_TENSOR: Tolerance(0.035, 0.25, "vLLM test_block_fp8 atol=rtol=0.035"),
    QuantKind.W8A8_INT8: Tolerance(0.065, 0.3, "vLLM test_block_int8 0.065"),
    QuantKind.NVFP4: Tolerance(0.1, 0.5, "vLLM test_nvfp4_moe 0.1"),
}


def tolerance_for(quant: QuantScheme, dtype: torch.dtype) -> Tolerance:
    if quant.kind is QuantKind.BF16:
        return _UNQUANTIZED[dtype]
    return _QUANTIZED[quant.kind]


@dataclass(frozen=True, slots=True)
class Comparison:
    ok: bool
    rel_l2: float
    rel_max: float
    detail: str


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare a backend's output with the oracle's under `tol`."""
    if out.shape != ref.shape:
        return Comparison(False, float("inf"), float("inf"), f"shape {list(out.shape)} != {list(ref.shape)}")
    if out.numel() == 0:
        return Comparison(True, 0.0, 0.0, "empty output")
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(o).all():
        return Comparison(False, float("nan"), float("nan"), "output contains NaN or Inf")
    diff = o - r
    ref_l2, ref_max = r.norm().item(), r.abs().max().item()
    if ref_max == 0.0:
        ok = diff.abs().max().item() == 0.0
        return Comparison(ok, 0.0 if ok else float("inf"), 0.0 if ok else float("inf"), "reference is all zeros")
    rel_l2, rel_max = diff.norm().item() / ref_l2, diff.abs().max().item() / ref_max
    ok = rel_l2 <= tol.rel_l2 and rel_max <= tol.rel_max
    detail = f"rel_l2 {rel_l2:.2e} (<= {tol.rel_l2:g}), rel_max {rel_max:.2e} (<= {tol.rel_max:g})"
    return Comparison(ok, rel_l2, rel_max, detail)
