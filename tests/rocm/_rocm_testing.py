"""Helpers for the ROCm backend tests (no assertions here)."""

from __future__ import annotations

import os

import moehal
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
ON_ROCM = torch.cuda.is_available() and getattr(torch.version, "hip", None) is not None
ON_NVIDIA = torch.cuda.is_available() and not ON_ROCM

# The Triton kernels run in the interpreter on CPU (CI: TRITON_INTERPRET=1 for the whole run, set
# before triton is imported), else compiled on a GPU.
needs_triton = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()),
    reason="the Triton path needs TRITON_INTERPRET=1 (CPU interpreter, set before the run starts) or a GPU",
)
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else "cpu")

# max|out - ref| / max|ref| per scheme (design-anchors.md section 6)
TOL = {"bf16": 2e-2, "fp8_block": 0.035, "fp8_block:ue8m0": 0.035, "fp8_tensor": 0.035, "w8a8_int8": 0.065}
TOL_DTYPE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def problem(cfg: moehal.MoEConfig, quant: str, t: int, seed: int = 0):
    """(canonical weights, x, global topk ids, topk weights) on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(e, cfg.w13_rows, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    b13 = torch.randn(e, cfg.w13_rows, generator=gen) * 0.1 if cfg.has_w13_bias else None
    b2 = torch.randn(e, h, generator=gen) * 0.1 if cfg.has_w2_bias else None
    x = torch.randn(t, h, generator=gen)
    w = moehal.quantize_weights(
        cfg, moehal.QuantScheme.parse(quant), w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=x
    )
    if t:
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(t)])
    else:
        ids = torch.zeros(0, cfg.top_k, dtype=torch.int64)
    wts = torch.rand(t, cfg.top_k, generator=gen) + 0.1
    return w.to(DEVICE), x.to(cfg.dtype).to(DEVICE), ids.to(torch.int32).to(DEVICE), wts.to(DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite values in the output"
    scale = ref.float().abs().max().clamp_min(1e-6)
    return float((out.float() - ref.float()).abs().max() / scale)


def triton_registry() -> moehal.Registry:
    """The reference plugin plus the ROCm Triton experts, on whatever device runs this test
    (on an NVIDIA GPU this is also how the CUDA backend reuses the class)."""
    from moehal.kernels.triton_experts import TritonExperts, TritonWeightProcessor
    from moehal.reference import plugin as reference_plugin

    devices = frozenset({"cuda"}) if ON_NVIDIA else frozenset({"rocm"})

    class _Plugin:
        @moehal.hookimpl
        def moehal_backend_info(self) -> moehal.BackendInfo:
            return moehal.BackendInfo(name="tritonmoe", version="0", description="ROCm Triton experts, reused")

        @moehal.hookimpl
        def moehal_experts(self):
            return [TritonExperts(devices=devices)]

        @moehal.hookimpl
        def moehal_weight_processors(self):
            return [TritonWeightProcessor(devices=devices | {"cpu"})]

    reg = moehal.Registry(moehal.Settings())
    reg.register(reference_plugin, "reference")
    reg.register(_Plugin(), "tritonmoe")
    return reg
