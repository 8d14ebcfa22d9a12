"""Declarations of the cuda plugin: discovery, honest declines with reasons, shape/quant gates."""

from __future__ import annotations

import pytest
import torch
from moehal.config import MoEConfig
from moehal.errors import NotSupportedError
from moehal.formats import ActivationFormat, Layout, ScaleKind
from moehal.hardware import HardwareInfo
from moehal.interfaces import BuildRequest
from moehal.quant import QuantScheme
from moehal_cuda import plugin
from moehal_cuda.deepgemm_experts import DeepGemmExperts
from moehal_cuda.dispatch import CudaPermuteDispatcher

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=512, intermediate_size=256)


def _req(sm: tuple[int, int] | None, quant: str = "bf16", cfg: MoEConfig = CFG) -> BuildRequest:
    if sm is None:
        hw = HardwareInfo("cpu", torch.device("cpu"), "cpu")
    else:
        hw = HardwareInfo("cuda", torch.device("cuda", 0), "fake", sm)
    return BuildRequest(cfg, QuantScheme.parse(quant), hw)


def test_backend_info_declines_without_cuda():
    info = plugin.moehal_backend_info()
    assert info.name == "cuda"
    d = info.available(HardwareInfo("cpu", torch.device("cpu"), "cpu"))
    assert not d.ok and "no CUDA device" in d.reason
    libs = info.libraries()
    assert {"torch", "triton", "deep_gemm", "flashinfer", "deep_ep"} <= set(libs)


def test_deepgemm_declines_on_cpu_and_old_gpus_with_reasons():
    ex = DeepGemmExperts()
    d = ex.check_hardware(_req(None))
    assert not d.ok and "needs an NVIDIA GPU" in d.reason
    d = ex.check_hardware(_req((8, 0)))
    assert not d.ok and "SM90 (Hopper)" in d.reason and "sm80" in d.reason
    assert ex.check_hardware(_req((9, 0))).ok and ex.check_hardware(_req((10, 0))).ok


def test_deepgemm_shape_and_quant_gates():
    ex = DeepGemmExperts()
    assert ex.check_shape(_req((9, 0), "fp8_block")).ok
    odd = CFG.with_(intermediate_size=192)
    d = ex.check_shape(_req((9, 0), "fp8_block", odd))
    assert not d.ok and "intermediate_size=192" in d.reason and "128" in d.reason
    assert ex.check_shape(_req((9, 0), "bf16", odd)).ok  # K % 64 suffices for bf16
    d = ex.check_shape(_req((9, 0), "bf16", CFG.with_(dtype=torch.float16)))
    assert not d.ok and "bf16" in d.reason
    d = ex.check_quant(_req((10, 0), "fp8_block"))
    assert not d.ok and "fp8_block:ue8m0" in d.reason
    assert ex.check_quant(_req((10, 0), "fp8_block:ue8m0")).ok
    assert ex.check_quant(_req((9, 0), "fp8_block")).ok
    assert not ex.check_quant(_req((9, 0), "w8a8_int8")).ok


def test_deepgemm_takes_fp8_tensor_on_sm90_as_static_block_scales(monkeypatch):
    """fp8 per-tensor: DeepGEMM's block-scale GEMMs with every block holding the expert's scale,
    fed by a dispatcher that quantizes with the static input scale. SM100 declines (its
    DeepGEMM reads power-of-two scales only)."""
    import moehal_cuda.deepgemm_experts as dge
    from moehal.weights import quantize_weights

    monkeypatch.setattr(dge.DeepGemmExperts, "_alignment", lambda self: 128)  # no deep_gemm on CPU
    ex = DeepGemmExperts()
    req = _req((9, 0), "fp8_tensor")
    assert ex.check_quant(req).ok and ex.check_shape(req).ok
    d = ex.check_quant(_req((10, 0), "fp8_tensor"))
    assert not d.ok and "UE8M0" in d.reason and "TensorRT-LLM" in d.reason
    d = ex.check_shape(_req((9, 0), "fp8_tensor", CFG.with_(intermediate_size=192)))
    assert not d.ok and "128" in d.reason
    fmts = ex.input_formats(req)
    assert {f.scales for f in fmts} == {ScaleKind.STATIC_TENSOR} and {f.dtype for f in fmts} == {torch.float8_e4m3fn}
    assert all(CudaPermuteDispatcher().can_produce(f, req).ok for f in fmts)
    small = ex.small_batch_format(req)  # decode batches: the portable fused MoE, unquantized token-major input
    assert small is not None and small.max_tokens == 128 and small.fmt.scales is ScaleKind.NONE
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(8, 512, 512, generator=g), torch.randn(8, 512, 256, generator=g)
    w = quantize_weights(CFG, req.quant, w13, w2, calibration_input=torch.randn(4, 512, generator=g))
    dw = dge.prepare_weights(w, req.quant, False, None)
    assert dw.w13_scale.shape == (8, 4, 4) and dw.w2_scale.shape == (8, 4, 2)
    assert torch.equal(dw.w13_scale, w.w13_scale[:, None, None].expand(8, 4, 4))
    assert torch.equal(dw.w2_scale, w.w2_scale[:, None, None].expand(8, 4, 2))
    assert torch.equal(dw.a2_scale, w.a2_scale.reshape(1)) and dw.w13 is not None


def test_permute_dispatcher_formats(monkeypatch):
    dsp = CudaPermuteDispatcher()
    req = _req((9, 0))
    assert dsp.can_produce(ActivationFormat(Layout.MASKED, torch.bfloat16), req).ok
    assert dsp.can_produce(ActivationFormat(Layout.CONTIGUOUS, torch.float8_e4m3fn, ScaleKind.GROUP_128, 128), req).ok
    assert not dsp.can_produce(ActivationFormat(Layout.MASKED, torch.int8, ScaleKind.PER_TOKEN), req).ok
    assert dsp.can_produce(ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.STATIC_TENSOR, 64), req).ok
    assert not dsp.can_produce(ActivationFormat("deepep_ll", torch.bfloat16), req).ok
    from moehal.kernels import host

    monkeypatch.setattr(host, "_KERNEL_MODE", [])  # a process whose kernels were never imported
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    d = dsp.check_hardware(_req(None))
    assert not d.ok and "no CUDA device" in d.reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dsp.check_hardware(_req(None)).ok
    assert dsp.execution_mode(_req(None)) == "interpreted"


def test_registrations_are_declared():
    names = {d.name for d in plugin.moehal_dispatchers()}
    assert "permute" in names
    assert "deepgemm" in {e.name for e in plugin.moehal_experts()}
    assert "deepgemm" in {p.layout for p in plugin.moehal_weight_processors()}


def test_sm100_paths_decline_on_hopper_with_the_reason():
    from moehal.routing import RoutingConfig
    from moehal_cuda.flashinfer_moe import CuteDslNvfp4Experts, TrtllmFp8BlockMoE

    cfg = CFG.with_(routing=RoutingConfig("deepseek_v3", n_group=2, topk_group=1, has_correction_bias=True))
    for impl in [TrtllmFp8BlockMoE(), *CuteDslNvfp4Experts.variants()]:
        d = impl.check_hardware(_req((9, 0), cfg=cfg))
        what = "TensorRT-LLM-gen MoE" if "trtllm" in impl.name else "FlashInfer CuteDSL NVFP4"
        assert not d.ok
        assert d.reason == f"{what} needs SM100 (Blackwell) or SM103 (Blackwell Ultra); this device is sm90"
        assert impl.check_hardware(_req((10, 0), cfg=cfg)).ok


def test_cutedsl_registers_one_variant_per_dispatch_layout():
    from moehal_cuda.flashinfer_moe import CuteDslNvfp4Experts

    req = _req((10, 0), "nvfp4")
    layouts = {v.input_formats(req)[0].layout for v in CuteDslNvfp4Experts.variants()}
    assert layouts == {Layout.MASKED, Layout.STANDARD}


def test_deepep_declines_layers_that_are_not_bf16():
    """Both DeepEP modes send the layer's hidden states as they are, and DeepEP reads bf16 (low
    latency asserts it; normal mode sizes its buffers for 2-byte elements): an fp16 layer is
    declined with the reason, for unquantized and FP8 formats alike."""
    from moehal_cuda.deepep import DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher

    cfg = MoEConfig(num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, ep_size=8, max_tokens=128)
    pairs = ((DeepEPLowLatencyDispatcher(), Layout.MASKED), (DeepEPNormalDispatcher(), Layout.CONTIGUOUS))
    for dispatcher, layout in pairs:
        fp8 = ActivationFormat(layout, torch.float8_e4m3fn, ScaleKind.GROUP_128, 64)
        assert dispatcher.can_produce(fp8, _req((9, 0), cfg=cfg)).ok
        half = cfg.with_(dtype=torch.float16)
        for fmt in (fp8, ActivationFormat(layout, torch.float16, ScaleKind.NONE, 64)):
            d = dispatcher.can_produce(fmt, _req((9, 0), cfg=half))
            assert not d.ok and d.reason == "DeepEP sends bf16 hidden states; the layer dtype is torch.float16"


def test_deepep_limits_checked_at_build():
    from moehal_cuda.deepep import DeepEPLowLatencyDispatcher

    ll = DeepEPLowLatencyDispatcher
    ok = MoEConfig(num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, ep_size=8, max_tokens=128)
    assert ll.check_limits(_req((9, 0), cfg=ok)).ok
    d = ll.check_limits(_req((9, 0), cfg=ok.with_(hidden_size=1536)))
    assert not d.ok and "hidden sizes" in d.reason
    d = ll.check_limits(_req((9, 0), cfg=ok.with_(top_k=12)))
    assert not d.ok and "top_k <= 11" in d.reason
    d = ll.check_limits(_req((9, 0), cfg=ok.with_(max_tokens=600)))
    assert not d.ok and "NVSHMEM_QP_DEPTH" in d.reason
    d = ll.check_limits(_req((9, 0), cfg=ok.with_(max_tokens=None)))
    assert not d.ok and "max_tokens" in d.reason
    fp8 = ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128)
    d = ll().can_produce(fp8, _req((9, 0), cfg=ok.with_(hidden_size=1792)))
    assert not d.ok and "512" in d.reason
    assert not ll().check_parallel(_req((9, 0), cfg=ok)).ok  # no process group given


def test_deepep_low_latency_sizes_of_v2_builds_are_asked_of_the_build(monkeypatch):
    """Hidden sizes 3072 and 3584 and top_k 10-11 came with DeepEP's v2 layout (sgl-deep-ep
    shares it); a build without `deep_ep.buffers.legacy` (v1.2.1: neither size, top_k <= 9)
    asserts at the first dispatch, so it is declined at build. Without deep_ep it is the
    library check's to decline."""
    import sys
    import types

    from moehal_cuda.deepep import DeepEPLowLatencyDispatcher

    ll = DeepEPLowLatencyDispatcher
    ok = MoEConfig(num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, ep_size=8, max_tokens=128)
    newer = (ok.with_(hidden_size=3584), ok.with_(hidden_size=3072), ok.with_(top_k=10))
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))  # v1: no buffers package
    assert ll.check_limits(_req((9, 0), cfg=ok)).ok and ll.check_limits(_req((9, 0), cfg=ok.with_(top_k=9))).ok
    for cfg in newer:
        d = ll.check_limits(_req((9, 0), cfg=cfg))
        assert not d.ok and "deep_ep.buffers.legacy" in d.reason and "v1.2.1" in d.reason, d.reason
    for name in ("deep_ep.buffers", "deep_ep.buffers.legacy"):  # v2's layout
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert all(ll.check_limits(_req((9, 0), cfg=cfg)).ok for cfg in newer)


def test_deepep_limits_from_the_second_audit(monkeypatch):
    """Session 40's read of DeepEP: max_tokens <= 1024 (its arrival counters; SGLang asserts
    it), FP8 low latency with rows per expert a multiple of 128 (sgl-deep-ep's scale stride),
    hidden 3584 among the low-latency sizes, and low latency's rank rule (fewer than 8 or a
    multiple of 8) in place of normal mode's config table."""
    from moehal_cuda.deepep import DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher

    ll = DeepEPLowLatencyDispatcher
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "8192")
    ok = MoEConfig(num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, ep_size=8, max_tokens=128)
    assert ll.check_limits(_req((9, 0), cfg=ok.with_(max_tokens=1024))).ok
    d = ll.check_limits(_req((9, 0), cfg=ok.with_(max_tokens=1032)))
    assert not d.ok and "max_tokens <= 1024" in d.reason
    assert ll.check_limits(_req((9, 0), cfg=ok.with_(hidden_size=3584))).ok
    fp8 = ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128, 64)
    assert ll().can_produce(fp8, _req((9, 0), cfg=ok.with_(max_tokens=16))).ok  # 8 x 16 = 128 rows
    d = ll().can_produce(fp8, _req((9, 0), cfg=ok.with_(max_tokens=8)))  # 64 rows
    assert not d.ok and "multiple of 128" in d.reason
    bf16 = ActivationFormat(Layout.MASKED, torch.bfloat16, ScaleKind.NONE, 64)
    assert ll().can_produce(bf16, _req((9, 0), cfg=ok.with_(max_tokens=8))).ok  # bf16 has no scales
    hw = _req((9, 0)).hardware

    def parallel(dispatcher, ranks: int):
        cfg = ok.with_(num_experts=8 * ranks, ep_size=ranks)
        return dispatcher.check_parallel(BuildRequest(cfg, QuantScheme.parse("bf16"), hw, process_group=object()))

    assert parallel(ll(), 12).reason.startswith("DeepEP buffers take fewer than 8 ranks or a multiple of 8")
    assert parallel(ll(), 40).ok  # no normal-mode config for 40 ranks; low latency needs none
    assert not parallel(DeepEPNormalDispatcher(), 40).ok
    assert parallel(ll(), 6).ok


def test_deepep_releases_without_the_calls_moehal_makes_are_declined_at_build(monkeypatch):
    """A `deep_ep` whose Buffer lacks a call a mode makes is declined by that mode's library
    check, with the missing calls named, not met at the first forward. A release from before
    `round_scale` (DeepEP PR #206) still serves bf16 and float-scale FP8 low latency, and
    declines power-of-two scales with the reason; the runner asks for `round_scale` only then."""
    import sys
    import types

    from moehal_cuda.deepep import DeepEPLowLatencyDispatcher, DeepEPLowLatencyRunner, DeepEPNormalDispatcher

    class OldBuffer:  # a low-latency API from before round_scale, and no normal mode
        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1):
            pass

        @staticmethod
        def get_low_latency_rdma_size_hint(t_max, hidden, num_ranks, num_experts):
            return 1

        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True):
            raise AssertionError("not called here")

        def low_latency_combine(self, x, topk_idx, topk_weights, handle):
            raise AssertionError("not called here")

    old = types.ModuleType("deep_ep")
    old.Buffer = OldBuffer
    monkeypatch.setitem(sys.modules, "deep_ep", old)
    monkeypatch.setattr("moehal_cuda.deepep.module_available", lambda name: True)
    cfg = MoEConfig(num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, ep_size=8, max_tokens=16)
    req = _req((9, 0), cfg=cfg)
    ll, normal = DeepEPLowLatencyDispatcher(), DeepEPNormalDispatcher()
    assert ll.check_libraries(req).ok
    d = normal.check_libraries(req)
    assert not d.ok and "has no Buffer.get_dispatch_config, Buffer.get_dispatch_layout, Buffer.dispatch" in d.reason
    assert "legacy Buffer API" in d.reason
    float_scales = ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128, 128)
    pow2_scales = ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128_UE8M0, 128)
    assert ll.can_produce(float_scales, req).ok
    assert ll.can_produce(ActivationFormat(Layout.MASKED, torch.bfloat16, ScaleKind.NONE, 128), req).ok
    d = ll.can_produce(pow2_scales, req)
    assert not d.ok and "takes no round_scale (DeepEP PR #206" in d.reason
    monkeypatch.setattr("moehal_cuda.deepep.shared_buffer", lambda *a, **k: None)
    assert DeepEPLowLatencyRunner(req, float_scales).scale_kw == {}
    assert DeepEPLowLatencyRunner(req, pow2_scales).scale_kw == {"round_scale": True}


def test_deepgemm_prefers_masked_while_its_worst_case_buffers_fit(monkeypatch):
    import moehal_cuda.deepgemm_experts as dge
    from moehal.settings import Settings

    monkeypatch.setattr(dge.DeepGemmExperts, "_alignment", lambda self: 128)  # no deep_gemm on CPU
    ex = DeepGemmExperts()
    qwen = MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, max_tokens=4096)
    req = _req((9, 0), "bf16", qwen)
    # [128 experts, 4096 rows] x (2048 in + 1536 gemm1 + 768 act + 2048 out) bf16 = 6.25 GiB
    assert dge.masked_workspace_bytes(req) == 128 * 4096 * (2048 + 1536 + 768 + 2048) * 2
    assert ex.input_formats(req)[0].layout is Layout.MASKED  # fits the default 8 GiB
    tight = BuildRequest(qwen, req.quant, req.hardware, Settings(masked_workspace_gib=4.0))
    assert ex.input_formats(tight)[0].layout is Layout.CONTIGUOUS
    unbounded = _req((9, 0), "bf16", qwen.with_(max_tokens=None))
    assert ex.input_formats(unbounded)[0].layout is Layout.CONTIGUOUS
    fp8 = _req((9, 0), "fp8_block", qwen)  # fp8 inputs and activations: one byte each
    assert dge.masked_workspace_bytes(fp8) == 128 * 4096 * (2048 + 1536 * 2 + 768 + 2048 * 2)


def test_deepgemm_says_once_why_it_takes_the_contiguous_layout(monkeypatch, caplog):
    """The plan named only `contiguous[...]`; nothing said that the masked buffers were over the
    budget, or that max_tokens was unset. Now one INFO line per configuration says which."""
    import moehal_cuda.deepgemm_experts as dge
    from moehal.settings import Settings

    monkeypatch.setattr(dge.DeepGemmExperts, "_alignment", lambda self: 128)
    monkeypatch.setattr(dge, "_NOTED", set())
    # build's GPU parts, stubbed: what is under test is what it says, on the CPU
    monkeypatch.setattr(dge, "DeepGemmOps", lambda fp8, sm100: None)
    monkeypatch.setattr(dge, "GemmChooser", lambda name: None)
    monkeypatch.setattr(dge, "claim_deep_gemm_device", lambda req: None)
    monkeypatch.setattr(dge, "DeepGemmExpertsRunner", lambda *args: args[1])
    monkeypatch.setattr(dge.DeepGemmExperts, "small_batch_format", lambda self, req: None)
    ex = DeepGemmExperts()
    qwen = MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, max_tokens=4096)
    req = _req((9, 0), "bf16", qwen)
    tight = BuildRequest(qwen, req.quant, req.hardware, Settings(masked_workspace_gib=4.0))
    unbounded = _req((9, 0), "bf16", qwen.with_(max_tokens=None))
    with caplog.at_level("INFO", logger="moehal_cuda.deepgemm_experts"):
        for r in (req, tight, tight, unbounded, unbounded):
            ex.input_formats(r)  # selection and `moehal explain` asking: no line
        assert not caplog.records
        for r in (req, tight, tight, unbounded, unbounded):
            ex.build(r, ex.input_formats(r)[0])
        ex.build(req, ex.input_formats(req)[1])  # contiguous asked for (layout=), masked would fit: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # none while masked fits; once per configuration
    assert "6.25 GiB, over the masked_workspace_gib budget of 4 GiB" in lines[0]
    assert "max_tokens is unset" in lines[1] and "runs the contiguous layout" in lines[1]


def test_masked_workspace_budget_counts_every_rank_behind_an_ep_dispatcher(monkeypatch):
    """Behind an expert-parallel dispatcher an expert's masked rows are max_tokens x ep_size
    (every rank may send its whole batch to it). The budget once counted max_tokens alone, so a
    DeepSeek-V3 EP8 fp8 layer at 4096 tokens took masked on 3.9 GiB and got 31 GiB of buffers."""
    import moehal_cuda.deepgemm_experts as dge

    monkeypatch.setattr(dge.DeepGemmExperts, "_alignment", lambda self: 128)  # no deep_gemm on CPU
    ds = MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, max_tokens=4096, ep_size=8)
    one_process = _req((9, 0), "fp8_block", ds)  # a slice computed in one process: max_tokens rows
    per_row = 7168 + 2048 * 2 * 2 + 2048 + 7168 * 2
    assert dge.masked_workspace_bytes(one_process) == 32 * 4096 * per_row
    assert DeepGemmExperts().input_formats(one_process)[0].layout is Layout.MASKED  # 3.9 GiB
    ranks = BuildRequest(ds, one_process.quant, one_process.hardware, process_group=object())
    assert dge.masked_workspace_bytes(ranks) == 32 * 4096 * 8 * per_row  # 31 GiB
    assert DeepGemmExperts().input_formats(ranks)[0].layout is Layout.CONTIGUOUS


def test_masked_workspace_budget_reads_from_the_environment():
    from moehal.settings import Settings

    assert Settings.from_env({}).masked_workspace_gib == 8.0
    assert Settings.from_env({"MOEHAL_MASKED_WORKSPACE_GIB": "2.5"}).masked_workspace_gib == 2.5
    import pytest

    with pytest.raises(ValueError, match="number of GiB"):
        Settings.from_env({"MOEHAL_MASKED_WORKSPACE_GIB": "lots"})


def test_deepgemm_experts_stay_on_the_gpu_of_the_first_deepgemm_layer(monkeypatch):
    """sgl-deep-gemm loads each JIT kernel on the GPU that first ran it (one cache per process):
    once a DeepGEMM layer is built on one GPU, layers on another decline with the reason, and
    selection goes on to the next experts kernel."""
    from moehal_cuda import support

    monkeypatch.setattr(support, "_DG_DEVICE", {})
    on = {i: BuildRequest(CFG, QuantScheme.parse("bf16"), HardwareInfo("cuda", torch.device("cuda", i), "fake", (9, 0)))
          for i in (0, 1)}  # fmt: skip
    experts = DeepGemmExperts()
    assert experts.check_hardware(on[1]).ok and experts.check_hardware(on[0]).ok  # nothing claimed yet
    support.claim_deep_gemm_device(on[1])
    support.claim_deep_gemm_device(on[1])  # again, by another layer on that GPU
    # a layer on cuda:0 that passed selection before cuda:1's claim (two threads building at
    # once) loses the race at its build, loudly: the first claim stays
    with pytest.raises(NotSupportedError, match=r"claimed for cuda:1 .* on cuda:0"):
        support.claim_deep_gemm_device(on[0])
    assert experts.check_hardware(on[1]).ok
    d = experts.check_hardware(on[0])
    assert not d.ok and d.predicate == "hardware"
    assert "loaded on cuda:1" in d.reason and "fail on cuda:0" in d.reason and "one process per GPU" in d.reason
    assert support.deep_gemm_device_decision(_req(None)).ok  # a CPU request names no GPU


def test_a_deepgemm_build_that_fails_claims_no_gpu(monkeypatch):
    """The GPU is claimed once the build can no longer fail: a build whose DeepGEMM ops raised
    (an import or a JIT lookup) kept its claim, and DeepGEMM was then declined on every other GPU."""
    from moehal_cuda import deepgemm_experts as dge
    from moehal_cuda import support

    monkeypatch.setattr(support, "_DG_DEVICE", {})

    def ops_fail(*args, **kwargs):
        raise ImportError("deep_gemm: JIT include dir not found")

    monkeypatch.setattr(dge, "DeepGemmOps", ops_fail)
    on = {i: BuildRequest(CFG, QuantScheme.parse("bf16"), HardwareInfo("cuda", torch.device("cuda", i), "fake", (9, 0)))
          for i in (0, 1)}  # fmt: skip
    with pytest.raises(ImportError):
        DeepGemmExperts().build(on[0], ActivationFormat(Layout.MASKED, torch.bfloat16))
    assert support._DG_DEVICE == {}
    assert support.deep_gemm_device_decision(on[1]).ok


def test_a_conformance_report_on_an_sm90_gpu_says_which_paths_need_sm100():
    # The components section of `moehal conformance --backend cuda` on an H100 or H200: the
    # SM100-only paths read "not run" with their own hardware check's reason, not silence.
    import moehal
    from moehal.selection import machine_decision
    from moehal_conformance import components
    from moehal_conformance.suite import Suite

    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    hopper = HardwareInfo("cuda", torch.device("cuda", 0), "Test GPU 80GB", (9, 0))
    rows = {c.qualname: c for c in components.summarize(Suite("cuda", reg, torch.device("cpu")), hopper)}
    sm100_only = ["cuda.cutedsl_nvfp4", "cuda.cutedsl_nvfp4_masked", "cuda.trtllm_fp8_block", "cuda.trtllm_fp8_tensor"]
    for name in sm100_only:
        assert rows[name].status == "not run", rows[name]
        assert rows[name].detail.startswith("[hardware]") and "needs SM100" in rows[name].detail, rows[name]
        assert rows[name].detail.endswith("this device is sm90"), rows[name]
    assert {rows[n].kind for n in sm100_only} == {"experts", "fused"}
    # `moehal doctor` asks the same machine-level question of each component.
    for name in sm100_only:
        impl = next(i for i in reg.all_implementations() if i.qualname == name)
        d = machine_decision(impl, hopper, reg.settings)
        assert not d.ok and d.predicate == "hardware" and "needs SM100" in d.reason, d
    assert rows["cuda.deepep"].kind == rows["cuda.deepep_ll"].kind == "dispatcher"


def test_nvfp4_dequant_experts_need_no_deep_gemm(monkeypatch):
    """Since session 50 the NVFP4 experts for Hopper run Triton's GEMMs only: without deep_gemm
    (its wheels are tied to one torch release) they are still accepted, take DeepGEMM's layouts
    at its SM90 alignment without importing it, and ignore DeepGEMM's one-GPU-per-process pin,
    while the DeepGEMM experts decline with the reason. Decode batches take the token-major
    kernels by the bf16 layers' rule (since session 51), or never with `small_batch_max_tokens` 0."""
    from moehal_cuda import deepgemm_experts, support
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts

    def no_deep_gemm():
        raise ImportError("deep_gemm is not installed")

    real = support.module_available
    monkeypatch.setattr(support, "module_available", lambda name: name != "deep_gemm" and real(name))
    monkeypatch.setattr(deepgemm_experts, "import_deep_gemm", no_deep_gemm)
    monkeypatch.setattr(support, "_DG_DEVICE", {"index": 1})  # a DeepGEMM layer was built on cuda:1
    req = _req((9, 0), "nvfp4", CFG.with_(max_tokens=4096))
    d = DeepGemmExperts().check_libraries(_req((9, 0), "bf16"))
    assert not d.ok and "deep_gemm is not installed" in d.reason
    ex = Nvfp4DequantExperts()
    if real("triton"):
        assert ex.check_libraries(req).ok
    assert ex.check_hardware(req).ok, "cuda:0 is free for Triton's kernels"
    assert not ex.check_hardware(_req((8, 0), "nvfp4")).ok
    formats = {f.layout: f for f in ex.input_formats(req)}
    assert formats[Layout.CONTIGUOUS].row_alignment == 128 and formats[Layout.MASKED].row_alignment == 128
    small = ex.small_batch_format(req)  # the bf16 layers' rule: one token here
    assert small is not None and small.fmt.layout is Layout.STANDARD and small.max_tokens == 1
    monkeypatch.setattr(Nvfp4DequantExperts, "small_batch_max_tokens", 0)
    assert ex.small_batch_format(req) is None  # decode batches masked
    monkeypatch.setattr(Nvfp4DequantExperts, "small_batch_max_tokens", None)
    big = CFG.with_(num_experts=32, hidden_size=7168, intermediate_size=2048, top_k=8)  # DeepSeek-V3's EP8 slice
    assert ex.small_batch_format(_req((9, 0), "nvfp4", big)) is None  # 704 MB a token: masked at every size


def test_sm100_ue8m0_weight_scales_must_be_finite_powers_of_two():
    """DeepGEMM's SM100 packing keeps each fp32 scale's exponent: a scale that is not a power of
    two stops the GPU at load, and Inf (exponent 0xFF, which UE8M0 reads as NaN) passed the
    bit check, whose mask sees only the sign and the mantissa."""
    from moehal.errors import WeightError
    from moehal_cuda.deepgemm_experts import check_power_of_two_scales

    check_power_of_two_scales(torch.tensor([1.0, 2.0**-20, 2.0**100, 0.0]), "w13_scale")
    for bad in (1.5, -2.0, float("inf"), float("nan")):
        with pytest.raises(WeightError, match="1 of 2 .* not finite positive powers of two"):
            check_power_of_two_scales(torch.tensor([4.0, bad]), "w13_scale")
