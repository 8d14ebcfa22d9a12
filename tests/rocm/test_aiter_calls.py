"""How `rocm.aiter` calls AITER, on the CPU, against a stand-in `aiter` package laid out as AMD
ships it (`amd-aiter`; ROCm/aiter `aiter/__init__.py` and `aiter/fused_moe.py`): the enums at
the top level, `fused_moe` in the `aiter.fused_moe` submodule, which `import aiter` does not
load. No AMD GPU is here; this checks moehal's side of the call (session 30's audit)."""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from typing import Any

import moehal
import pytest
import torch
from moehal.formats import ActivationFormat, Layout, StandardInput
from moehal.hardware import HardwareInfo
from moehal.interfaces import BuildRequest
from moehal_rocm.aiter_experts import AiterExperts

MI300 = HardwareInfo("rocm", torch.device("cpu"), "AMD Instinct MI300X", (9, 4), "gfx942")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    m.__path__ = []
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


class ActivationType(enum.Enum):
    Silu = 0
    Gelu = 1


class QuantType(enum.Enum):
    No = 0
    per_Token = 2
    per_128x128 = 4


@pytest.fixture
def fake_aiter(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple, dict]]:
    calls: list[tuple[tuple, dict]] = []

    def fused_moe(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(((hidden, *args), kwargs))
        return torch.zeros_like(hidden)

    top = _module("aiter", ActivationType=ActivationType, QuantType=QuantType)  # no fused_moe attribute
    monkeypatch.setitem(sys.modules, "aiter", top)
    monkeypatch.setitem(sys.modules, "aiter.fused_moe", _module("aiter.fused_moe", fused_moe=fused_moe))
    return calls


def _req(**kw: Any) -> BuildRequest:
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, **kw)
    return BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), MI300)


def test_fused_moe_comes_from_its_submodule(fake_aiter, monkeypatch):
    """Accepted with `fused_moe` only in `aiter.fused_moe` (a fresh process), and still called
    as the function once that submodule is an attribute of the package (after vLLM or SGLang
    imported it); declined, naming it, where the submodule is missing."""
    d = AiterExperts().check_libraries(_req())
    assert d.ok, d
    sys.modules["aiter"].fused_moe = sys.modules["aiter.fused_moe"]  # what an engine's import leaves
    req = _req(ep_size=2, ep_rank=1)
    runner = AiterExperts().build(req, ActivationFormat(Layout.STANDARD, torch.bfloat16))
    runner.load({"w13": torch.zeros(2, 256, 128), "w2": torch.zeros(2, 128, 128), "w13_scale": None, "w2_scale": None})
    ids = torch.tensor([[0, -1], [1, 0], [-1, -1]], dtype=torch.int64)
    out = runner.apply(StandardInput(torch.randn(3, 128).bfloat16(), None, ids, torch.rand(3, 2))).hidden
    assert out.shape == (3, 128)
    ((args, kw),) = fake_aiter
    assert args[4].dtype == torch.int32 and args[4].tolist() == [[0, 2], [1, 0], [2, 2]]  # remote -> masked E_local
    assert kw["expert_mask"].tolist() == [1, 1, 0] and kw["quant_type"] is QuantType.No
    monkeypatch.delitem(sys.modules, "aiter.fused_moe")
    del sys.modules["aiter"].fused_moe
    d = AiterExperts().check_libraries(_req())
    assert not d.ok and "aiter.fused_moe.fused_moe" in d.reason


def test_padding_ids_go_to_the_masked_out_expert_on_one_rank_too(fake_aiter):
    """With `topk_padding` a single rank's local ids hold -1 as well: they take the masked-out
    extra id, as other ranks' experts do under EP. Without it (and without EP) no mask is
    passed, as before."""
    runner = AiterExperts().build(_req(topk_padding=True), ActivationFormat(Layout.STANDARD, torch.bfloat16))
    runner.load({"w13": torch.zeros(4, 256, 128), "w2": torch.zeros(4, 128, 128), "w13_scale": None, "w2_scale": None})
    ids = torch.tensor([[3, -1], [-1, -1], [0, 2]], dtype=torch.int32)
    runner.apply(StandardInput(torch.randn(3, 128).bfloat16(), None, ids, torch.rand(3, 2)))
    ((args, kw),) = fake_aiter
    assert args[4].tolist() == [[3, 4], [4, 4], [0, 2]] and kw["expert_mask"].tolist() == [1, 1, 1, 1, 0]
    plain = AiterExperts().build(_req(), ActivationFormat(Layout.STANDARD, torch.bfloat16))
    assert plain.expert_mask is None


def test_aiter_gets_dense_operands(fake_aiter):
    """AITER's kernels take pointers, and its Python layer documents no strides: the caller's
    views (rows of a wider buffer, column-major top-k) reach it as dense copies."""
    runner = AiterExperts().build(_req(), ActivationFormat(Layout.STANDARD, torch.bfloat16))
    runner.load({"w13": torch.zeros(4, 256, 128), "w2": torch.zeros(4, 128, 128), "w13_scale": None, "w2_scale": None})
    wide = torch.randn(3, 192).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32).t().contiguous().t()
    wts = torch.rand(2, 3).t()
    runner.apply(StandardInput(wide[:, :128], None, ids, wts))
    ((args, _),) = fake_aiter
    hidden, w, i = args[0], args[3], args[4]
    assert hidden.is_contiguous() and w.is_contiguous() and i.is_contiguous()
    assert torch.equal(hidden, wide[:, :128]) and torch.equal(w, wts) and i.tolist() == ids.tolist()
    # dense rows 2 bytes past an aligned address: contiguous, so only the alignment shows
    odd = torch.randn(3 * 128 + 1).bfloat16()[1:].view(3, 128)
    runner.apply(StandardInput(odd, None, ids, wts))
    hidden = fake_aiter[-1][0][0]
    assert hidden.data_ptr() % 16 == 0 and torch.equal(hidden, odd)


def test_no_tokens_skip_the_kernel(fake_aiter):
    runner = AiterExperts().build(_req(), ActivationFormat(Layout.STANDARD, torch.bfloat16))
    runner.load({"w13": None, "w2": None, "w13_scale": None, "w2_scale": None})
    empty = StandardInput(torch.zeros(0, 128).bfloat16(), None, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2))
    assert runner.apply(empty).hidden.shape == (0, 128) and not fake_aiter


def test_aiter_is_not_claimed_deterministic():
    """CK's second stage adds the top-k rows into the output atomically, in no fixed order:
    conformance must not hold AITER to bitwise repeatability."""
    assert AiterExperts.deterministic is False


def test_int8_declines_on_gfx950_where_aiter_ships_no_kernel():
    """int8 per-token MoE takes AITER's ASM stage 1, whose kernels ship for gfx942 only
    (hsa/gfx942/fmoe_2stages): on gfx950 it would fail at the first forward ("not find
    kernel"), so it declines there and the Triton fused MoE takes the layer."""
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    int8, fp8 = moehal.QuantScheme.parse("w8a8_int8"), moehal.QuantScheme.parse("fp8_block")
    mi355 = HardwareInfo("rocm", torch.device("cpu"), "AMD Instinct MI355X", (9, 5), "gfx950")
    d = AiterExperts().check_quant(BuildRequest(cfg, int8, mi355))
    assert not d.ok and "gfx950" in d.reason and "Triton" in d.reason
    assert AiterExperts().check_quant(BuildRequest(cfg, int8, MI300)).ok
    assert AiterExperts().check_quant(BuildRequest(cfg, fp8, mi355)).ok


@pytest.mark.parametrize("quant", ["fp8_block", "w8a8_int8"])
def test_fp16_layers_of_quantized_schemes_are_declined(quant):
    """AITER's quantized MoE kernels write bf16 (its fused_moe_1stage_dict is keyed on bf16, and
    asm_stage1 takes bf16 only): fp16 layers of those schemes go to the Triton fused MoE."""
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, dtype=torch.float16)
    d = AiterExperts().check_shape(BuildRequest(cfg, moehal.QuantScheme.parse(quant), MI300))
    assert not d.ok and d.predicate == "shape" and "write bf16" in d.reason
    assert AiterExperts().check_shape(BuildRequest(cfg, moehal.QuantScheme.parse("bf16"), MI300)).ok
