"""The ROCm plugin's declarations on a machine without ROCm: availability, declines with reasons,
the slow torch fallback, AITER gating, and import hygiene."""

from __future__ import annotations

import subprocess
import sys

import moehal
import pytest
import torch
from moehal.hardware import HardwareInfo
from moehal.interfaces import BuildRequest
from moehal.kernels.triton_experts import TritonExperts

NO_ROCM = getattr(torch.version, "hip", None) is None


@pytest.fixture
def reg():
    r = moehal.Registry(moehal.Settings())
    r.load_entry_points()
    assert r.plugins["rocm"].status == "loaded", r.plugins["rocm"].error
    return r


def test_plugin_declares_its_implementations(reg):
    impls = set(reg.plugins["rocm"].implementations)
    assert {
        "rocm.aiter",
        "rocm.triton",
        "rocm.slow_torch_fallback",
        "rocm.triton_weights",
        "rocm.aiter_weights",
    } <= impls


@pytest.mark.skipif(not NO_ROCM, reason="checks the answer on a torch build without ROCm")
def test_backend_unavailable_without_rocm(reg, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    info = reg.plugins["rocm"].info
    d = info.available(moehal.detect("cpu"))
    assert not d.ok
    assert "no ROCm" in d.reason and "torch.version.hip is None" in d.reason
    libs = info.libraries()
    assert libs["hip"] is None and libs["torch"] == torch.__version__


@pytest.mark.skipif(not NO_ROCM, reason="checks the answer on a torch build without ROCm")
def test_triton_experts_decline_on_cpu_without_interpreter(reg, monkeypatch):
    from moehal.kernels import host

    monkeypatch.setattr(host, "_KERNEL_MODE", [])  # a process whose kernels were never imported
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
    req = BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), moehal.detect("cpu"))
    triton_experts = next(e for e in reg.experts if e.qualname == "rocm.triton")
    d = triton_experts.supports(req)
    assert not d.ok and d.predicate == "hardware" and "TRITON_INTERPRET=1" in d.reason
    # and the backend still builds: the slow fallback, saying so
    layer = moehal.MoELayer(cfg, "bf16", backend="rocm", device="cpu", registry=reg)
    assert layer.plan.pipeline.main.qualname == "rocm.slow_torch_fallback"


@pytest.mark.parametrize("quant", ["nvfp4", "fp8_tensor"])
def test_torch_fallback_for_schemes_no_kernel_takes(reg, quant, monkeypatch):
    if quant == "fp8_tensor":  # the Triton kernels take it where they run: take them away
        monkeypatch.setattr(TritonExperts, "interpret_on_cpu", False)
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
    layer = moehal.MoELayer(cfg, quant, backend="rocm", device="cpu", registry=reg)
    plan = layer.plan
    assert plan.pipeline.main.qualname == "rocm.slow_torch_fallback"
    # the plan says a slow catch-all was chosen, in words and in its JSON (`Implementation.fallback`)
    assert "the slow rocm fallback (rocm.slow_torch_fallback) was chosen" in str(plan)
    assert plan.as_dict()["pipeline"]["fallback"] is True
    chosen = [d for d in plan.decisions if d.name == "rocm.slow_torch_fallback"]
    assert chosen and chosen[0].ok and chosen[0].reason.startswith("slow fallback")
    declined = {d.name: d for d in plan.decisions if not d.ok}
    assert declined["rocm.triton"].predicate in ("quant", "hardware")
    # same numbers as the reference oracle
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 128, 64, generator=gen) / 8
    w2 = torch.randn(4, 64, 64, generator=gen) / 8
    x = torch.randn(5, 64, generator=gen)
    w = moehal.quantize_weights(cfg, moehal.QuantScheme.parse(quant), w13, w2, calibration_input=x)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]], dtype=torch.int32)
    wts = torch.rand(5, 2, generator=gen)
    ref = moehal.MoELayer(cfg, quant, backend="reference", device="cpu", registry=reg)
    layer.load_weights(w)
    ref.load_weights(w)
    xb = x.to(torch.bfloat16)
    assert torch.equal(layer(xb, ids, wts), ref(xb, ids, wts))


@pytest.mark.parametrize("quant", ["nvfp4", "bf16", "fp8_block", "w8a8_int8"])
def test_rocm_never_taken_automatically_without_rocm(reg, quant):
    """Even with TRITON_INTERPRET=1 (CI), automatic selection on CPU keeps the reference; only
    backend='rocm' gets the interpreted Triton kernels (or the slow fallback)."""
    if not NO_ROCM:
        pytest.skip("checks a torch build without ROCm")
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
    layer = moehal.MoELayer(cfg, quant, device="cpu", registry=reg)
    assert layer.plan.pipeline.main.qualname == "reference.experts"


def test_aiter_gated_on_hardware_and_library(reg, monkeypatch):
    from moehal_rocm import hw as rocm_hw

    aiter = next(e for e in reg.experts if e.qualname == "rocm.aiter")
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    mi300 = HardwareInfo("rocm", torch.device("cpu"), "AMD Instinct MI300X", (9, 4), "gfx942")
    mi200 = HardwareInfo("rocm", torch.device("cpu"), "AMD Instinct MI250X", (9, 0), "gfx90a")
    q = moehal.QuantScheme.parse("bf16")
    d = aiter.supports(BuildRequest(cfg, q, mi200))
    assert not d.ok and d.predicate == "hardware" and "gfx90a" in d.reason
    d = aiter.supports(BuildRequest(cfg, q, moehal.detect("cpu")))
    assert not d.ok and d.predicate == "hardware"
    monkeypatch.setattr(rocm_hw, "module_available", lambda name: False)
    d = aiter.supports(BuildRequest(cfg, q, mi300))
    assert not d.ok and d.predicate == "libraries" and "AITER is not installed" in d.reason


def test_triton_fp8_declined_on_gpus_without_fp8():
    from moehal.kernels.triton_experts import TritonExperts

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    mi200 = HardwareInfo("rocm", torch.device("cpu"), "AMD Instinct MI250X", (9, 0), "gfx90a")
    d = TritonExperts().supports(BuildRequest(cfg, moehal.QuantScheme.parse("fp8_block"), mi200))
    assert not d.ok and d.predicate == "quant" and "gfx90a" in d.reason
    d = TritonExperts().supports(BuildRequest(cfg, moehal.QuantScheme.parse("w8a8_int8"), mi200))
    assert d.ok, d
    a100 = HardwareInfo("cuda", torch.device("cpu"), "NVIDIA A100", (8, 0))
    d = TritonExperts(devices=frozenset({"cuda"})).supports(
        BuildRequest(cfg, moehal.QuantScheme.parse("fp8_block"), a100)
    )
    assert not d.ok and "sm80" in d.reason


def test_fnuz_conversion_is_lossless():
    from moehal.kernels.triton_experts import to_fnuz
    from moehal.quant import fp8

    bits = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    q = bits.view(torch.float8_e4m3fn)
    finite = torch.isfinite(q.float())
    scale = torch.tensor(0.37)
    qz, sz = to_fnuz(q, scale)
    assert qz.dtype == torch.float8_e4m3fnuz and torch.isfinite(qz.float()).all()
    assert torch.equal((qz.float() * sz)[finite], (q.float() * scale)[finite])
    # and a block-quantized weight dequantizes to the same values
    w = torch.randn(256, 128)
    qw, sw = fp8.quantize_block(w)
    qwz, swz = to_fnuz(qw, sw)
    assert torch.equal(fp8.dequantize_block(qwz, swz), fp8.dequantize_block(qw, sw))


def test_imports_stay_lazy():
    code = (
        "import sys, moehal, moehal.kernels, moehal_rocm.plugin; "
        "moehal.discover(); "
        "bad = [m for m in ('triton', 'aiter') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
