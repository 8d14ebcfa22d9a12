"""The CUDA backend's Triton kernels (the permute and combine, the experts' activation glue and
FP8 quantization, the masked grouped GEMMs, fused GEMM1 + activation, the token-major decode
kernels) compiled, not interpreted, for sm90 (H100), with the tiles the host code picks on a GPU
(`triton_aot`: launches recorded, then Triton's AOT compiler; no GPU needed). The interpreter
accepted code that the compiler refused once (session 8, 11 GPU test failures); this catches
that on the CPU. Compiling is not running: tests/cuda/test_gpu.py runs these on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def drive() -> None:
    """The DeepGEMM experts' pipeline (GEMMs as the torch stand-in) through the CUDA dispatcher,
    in the layouts, schemes and GEMM choices that reach different kernels or specializations."""
    from moehal.config import MoEConfig
    from moehal.formats import ActivationFormat, Layout
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.quant import QuantScheme
    from moehal.routing import TopK
    from moehal.weights import quantize_weights
    from moehal_cuda.deepgemm_experts import DeepGemmExpertsRunner, TorchGemmOps
    from moehal_cuda.dispatch import CudaPermuteDispatcher
    from test_deepgemm_glue import AlwaysTriton, DeepGemmWithPrefillFusion, _fmt

    cases = [
        ("bf16", Layout.MASKED, dict(), (None, AlwaysTriton, DeepGemmWithPrefillFusion)),
        ("bf16", Layout.CONTIGUOUS, dict(has_w13_bias=True, has_w2_bias=True, routed_scaling_factor=2.5), (None,)),
        ("bf16", Layout.MASKED, dict(activation="swiglu_oai", has_w13_bias=True), (AlwaysTriton,)),
        ("fp8_block", Layout.MASKED, dict(activation="gelu", gated=False), (None, AlwaysTriton)),
        ("fp8_block:ue8m0", Layout.CONTIGUOUS, dict(ep_rank=1, ep_size=2), (None,)),
        # static input scales: the scatter's and the activation's STATIC specializations
        ("fp8_tensor", Layout.MASKED, dict(), (None,)),
        ("fp8_tensor", Layout.CONTIGUOUS, dict(has_w13_bias=True), (None,)),
    ]
    g = torch.Generator().manual_seed(0)
    for quant_name, layout, extra, choosers in cases:
        cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=256, **extra)
        quant = QuantScheme.parse(quant_name)
        e = cfg.num_local_experts
        w13 = torch.randn(e, cfg.w13_rows, 512, generator=g) / 16
        w2 = torch.randn(e, 512, 256, generator=g) / 11
        b13 = torch.randn(e, cfg.w13_rows, generator=g) if cfg.has_w13_bias else None
        b2 = torch.randn(e, 512, generator=g) if cfg.has_w2_bias else None
        calib = torch.randn(8, 512, generator=g)
        weights = quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=calib)
        req = BuildRequest(cfg, quant, detect("cpu"))
        fmt = _fmt(quant, layout)
        for chooser in choosers:
            disp = CudaPermuteDispatcher().build(req, fmt)
            if weights.a13_scale is not None:  # as the layer hands it over
                disp.load_input_scale(weights.a13_scale.reshape(1))
            ex = DeepGemmExpertsRunner(req, fmt, TorchGemmOps(fmt.is_quantized), chooser() if chooser else None)
            ex.load(weights)
            for t in (3, 24, 256):  # decode, small, prefill-sized (more position chunks)
                x = torch.randn(t, 512, generator=g).bfloat16()
                ids = torch.rand(t, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].int()
                inp, handle = disp.dispatch(x, TopK(ids, torch.rand(t, cfg.top_k, generator=g)))
                disp.combine(ex.apply(inp), handle)
        if quant_name == "bf16" and layout is Layout.MASKED and not extra:  # decode batches token-major
            small = CudaPermuteDispatcher().build(req, ActivationFormat(Layout.STANDARD, cfg.dtype))
            ex = DeepGemmExpertsRunner(req, fmt, TorchGemmOps(False), None)
            ex.load(weights)
            x = torch.randn(2, 512, generator=g).bfloat16()
            ids = torch.rand(2, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].int()
            inp, handle = small.dispatch(x, TopK(ids, torch.rand(2, cfg.top_k, generator=g)))
            small.combine(ex.apply(inp), handle)
    drive_nvfp4(g)


def drive_nvfp4(g: torch.Generator) -> None:
    """The NVFP4-on-Hopper experts: the glue's NVFP4 quantizers, the Triton grouped GEMMs with
    per-expert output scales and biases, masked and contiguous, and the token-major decode
    kernels with output scales."""
    import dataclasses

    from moehal.config import MoEConfig
    from moehal.formats import Layout
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.quant import QuantScheme
    from moehal.routing import TopK
    from moehal.weights import quantize_weights
    from moehal_cuda.deepgemm_experts import TorchGemmOps
    from moehal_cuda.dispatch import CudaPermuteDispatcher
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts, Nvfp4DequantRunner
    from test_deepgemm_glue import _fmt

    cfg = MoEConfig(
        num_experts=8, top_k=2, hidden_size=512, intermediate_size=256, max_tokens=256, has_w13_bias=True,
        has_w2_bias=True,
    )  # fmt: skip
    quant = QuantScheme.parse("nvfp4")
    w13, w2 = torch.randn(8, cfg.w13_rows, 512, generator=g) / 16, torch.randn(8, 512, 256, generator=g) / 11
    b13, b2 = torch.randn(8, cfg.w13_rows, generator=g), torch.randn(8, 512, generator=g)
    calib = torch.randn(8, 512, generator=g)
    weights = quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=calib)
    req = BuildRequest(cfg, quant, detect("cpu"))
    for layout in (Layout.MASKED, Layout.CONTIGUOUS):
        fmt = _fmt(QuantScheme.parse("bf16"), layout)
        if layout is Layout.CONTIGUOUS:
            fmt = dataclasses.replace(fmt, row_alignment=128)
        disp = CudaPermuteDispatcher().build(req, fmt)
        ex = Nvfp4DequantRunner(req, fmt, TorchGemmOps(False))
        ex.load(weights)
        for t in (3, 256):
            x = torch.randn(t, 512, generator=g).bfloat16()
            ids = torch.rand(t, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].int()
            inp, handle = disp.dispatch(x, TopK(ids, torch.rand(t, cfg.top_k, generator=g)))
            disp.combine(ex.apply(inp), handle)
    small = Nvfp4DequantExperts().small_batch_format(req)  # the decode kernels' scaled, quantizing epilogues
    assert small is not None
    disp = CudaPermuteDispatcher().build(req, small.fmt)
    ex = Nvfp4DequantRunner(req, small.fmt, TorchGemmOps(False))
    ex.load(weights)
    x = torch.randn(1, 512, generator=g).bfloat16()
    inp, handle = disp.dispatch(x, TopK(torch.tensor([[3, 5]], dtype=torch.int32), torch.rand(1, 2, generator=g)))
    disp.combine(ex.apply(inp), handle)


@pytest.mark.timeout(1200)
def test_cuda_kernels_compile_for_sm90(tmp_path):
    from triton_aot import check_in_child

    report = check_in_child(__file__, "drive", ["sm90"], str(tmp_path))
    line = report.strip().splitlines()[-1].split()
    assert line[0] == "sm90", report
    compiled = set(line[2:])
    want = {"_scatter_rows", "_combine_rows", "_act_rows", "_masked_gemm_kernel", "_masked_gemm_act_kernel"}
    want |= {"_qdq_rows"}  # the NVFP4-on-Hopper experts' GEMM1 input
    assert want <= compiled, f"missing {want - compiled}: {report}"
    assert {"_token_gemm_act_kernel", "_token_gemm_combine_kernel"} <= compiled, report
