"""The CUDA experts declare the shapes their shipped tables tune (conformance's `tuned` family),
with a batch size for every path a layer of that shape can take up to 4096 tokens. Computed
from the committed tables on the CPU: the device's name is all the declaration reads."""

from __future__ import annotations

import moehal
import pytest
import torch
from moehal.hardware import HardwareInfo
from moehal.interfaces import BuildRequest
from moehal.kernels.triton_experts import TritonExperts
from moehal_cuda import deepgemm_experts as dge
from moehal_cuda.gemm_choice import GemmChooser

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
BF16 = moehal.QuantScheme.parse("bf16")


def _req(name: str, kind: str = "cuda") -> BuildRequest:
    hw = HardwareInfo(kind, torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), name, (9, 0))
    return BuildRequest(moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64), BF16, hw)


@pytest.fixture
def on_sm90(monkeypatch):
    """This CPU as an SM90 device with DeepGEMM and Triton: only the tables decide."""
    for cls in (dge.DeepGemmExperts, TritonExperts):
        monkeypatch.setattr(cls, "check_hardware", lambda self, req: moehal.accept(predicate="hardware"))
        monkeypatch.setattr(cls, "check_libraries", lambda self, req: moehal.accept(predicate="libraries"))
    monkeypatch.setattr(dge.DeepGemmExperts, "_alignment", lambda self: 128)


@pytest.mark.parametrize("device", [H200, H100])
def test_deepgemm_declares_every_path_of_the_tables_shapes(on_sm90, device):
    ex = dge.DeepGemmExperts()
    shapes = ex.tuned_shapes(_req(device))
    names = {(ts.name, ts.quant.name) for ts in shapes}
    for model in ("qwen3_30b_a3b", "deepseek_v3_ep8", "mixtral_8x7b"):
        assert {(model, "bf16"), (model, "fp8_block")} <= names, names
    chooser = GemmChooser(device)
    for ts in shapes:
        req = BuildRequest(ts.config, ts.quant, _req(device).hardware)
        small = ex.small_batch_format(req)
        from moehal.kernels.triton_experts import portable_tiles

        path = lambda t: dge._path_of(req, small, chooser, portable_tiles(req), t)  # noqa: B023, E731
        declared = {path(t) for t in ts.tokens}
        assert len(declared) == len(ts.tokens), f"{ts.name} {ts.quant.name}: two batches of one path"
        missing = sorted({t for t in range(1, ts.config.max_tokens + 1) if path(t) not in declared})
        assert not missing, f"{ts.name} {ts.quant.name}: batches of undeclared paths {missing[:5]}"


def test_qwen3_bf16_reaches_each_kind_of_kernel_on_the_h200(on_sm90):
    """The H200 table's Qwen3-30B-A3B bf16 rows: token-major at 1-4 tokens, the portable fused
    MoE in its measured band, Triton GEMMs (fused with the activation at decode sizes), and
    DeepGEMM's at prefill sizes."""
    (ts,) = [s for s in dge.DeepGemmExperts().tuned_shapes(_req(H200)) if s.name == "qwen3_30b_a3b" and s.quant == BF16]
    req = BuildRequest(ts.config, BF16, _req(H200).hardware)
    small = dge.DeepGemmExperts().small_batch_format(req)
    assert small is not None and small.max_tokens == 4 and small.prefill_min_tokens is not None
    assert {1, 2, 3, 4} <= set(ts.tokens)
    assert any(small.prefill_min_tokens <= t <= (small.prefill_max_tokens or t) for t in ts.tokens)
    plans = [
        dge.plan_masked(ts.config, False, GemmChooser(H200), 128, t * 8)
        for t in ts.tokens
        if not small.takes(t)  # the masked path's batches
    ]
    assert any(g1.triton and fused is not None for g1, _, fused in plans)  # decode: fused GEMM1 + activation
    assert any(not g1.triton and not g2.triton for g1, g2, _ in plans)  # prefill: DeepGEMM's GEMMs


def test_the_portable_kernel_declares_its_tuned_tiles(on_sm90):
    shapes = TritonExperts(devices=frozenset({"cuda"})).tuned_shapes(_req(H200))
    qwen = [s for s in shapes if s.name == "qwen3_30b_a3b" and s.quant == BF16]
    assert len(qwen) == 1 and len(qwen[0].tokens) >= 3


def test_every_cuda_experts_kernel_declares_on_the_h200_without_raising(on_sm90):
    """Session 45's first H200 run: the NVFP4-dequant experts inherited DeepGEMM's declaration
    and raised on their scheme. They run DeepGEMM at every size: nothing to declare."""
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts

    assert Nvfp4DequantExperts().tuned_shapes(_req(H200)) == ()
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    mine = [i for i in (*reg.experts, *reg.fused) if i.backend == "cuda"]
    assert len(mine) >= 4, [i.qualname for i in mine]
    for impl in mine:
        impl.tuned_shapes(_req(H200))  # raises nothing, whichever checks pass here


def test_no_table_or_no_gpu_declares_nothing(on_sm90):
    assert dge.DeepGemmExperts().tuned_shapes(_req("NVIDIA B200")) == ()
    assert dge.DeepGemmExperts().tuned_shapes(_req(H200, kind="cpu")) == ()
    assert TritonExperts().tuned_shapes(_req(H200, kind="cpu")) == ()
