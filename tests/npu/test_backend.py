"""The NPU backend end to end in emulated mode, against the reference backend; its declines."""

from __future__ import annotations

import subprocess
import sys

import moehal
import pytest
import torch
from moehal import MoEConfig, MoELayer
from moehal.errors import NoBackendError
from moehal.hardware import HardwareInfo, detect
from moehal.interfaces import BuildRequest
from moehal.quant import QuantScheme
from moehal_npu import common, experts, fuseep, ops, plugin, weights
from npu_helpers import make_problem, rel_err

TOL = {"bf16": 2e-2, "w8a8_int8": 0.065}
SMALL = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
FUSE = MoEConfig(num_experts=4, top_k=2, hidden_size=512, intermediate_size=512, max_tokens=16)


def _compare(cfg, quant, registry, t=12, **layer_kw):
    w, x, ids, wts = make_problem(cfg, quant, t)
    ref = MoELayer(cfg, quant, backend="reference", device="cpu", registry=registry)
    ref.load_weights(w)
    layer = MoELayer(cfg, quant, backend="npu", device="cpu", registry=registry, **layer_kw)
    layer.load_weights(w)
    return layer, rel_err(layer(x, ids, wts), ref(x, ids, wts))


@pytest.mark.parametrize("quant", ["bf16", "w8a8_int8"])
@pytest.mark.parametrize("layout", ["npu_ll_flat", "contiguous", "masked"])
def test_grouped_matmul_experts_every_layout(npu_registry, quant, layout):
    layer, err = _compare(SMALL, quant, npu_registry, layout=layout)
    p = layer.plan.pipeline
    assert p.kind == "modular" and p.experts.qualname == "npu.gmm" and p.fmt.layout_name == layout
    assert p.execution_mode(layer.request) == "emulated"
    if quant == "w8a8_int8":  # int8 rows with per-token scales, quantized by the dispatcher
        assert p.fmt.dtype == torch.int8 and p.fmt.scales.value == "per_token" and p.adapter is None
    if layout == "npu_ll_flat":
        assert p.dispatcher.qualname == "npu.local_flat"
    assert err < TOL[quant], err


@pytest.mark.parametrize("quant", ["bf16", "w8a8_int8"])
def test_default_pipeline_is_the_flat_layout(npu_registry, quant):
    layer, err = _compare(SMALL, quant, npu_registry)
    assert layer.plan.pipeline.name.startswith("npu.local_flat -> npu.gmm [npu_ll_flat")
    assert "EMULATED" in str(layer.plan)
    assert err < TOL[quant], err


@pytest.mark.parametrize("quant", ["bf16", "w8a8_int8"])
def test_scaling_partial_ep_and_weight_on_input(npu_registry, quant):
    cfg = SMALL.with_(routed_scaling_factor=2.5, ep_size=2, ep_rank=1)  # one process: this rank's partial sum
    _, err = _compare(cfg, quant, npu_registry)
    assert err < TOL[quant], err
    cfg1 = SMALL.with_(top_k=1, apply_router_weight_on_input=True)
    _, err1 = _compare(cfg1, quant, npu_registry)
    assert err1 < TOL[quant], err1


@pytest.mark.parametrize("quant", ["w8a8_int8"])
def test_fuseep_fused_deep_moe(npu_registry, quant):
    layer, err = _compare(FUSE, quant, npu_registry, t=16)
    p = layer.plan.pipeline
    assert p.kind == "fused" and p.fused.qualname == "npu.fuseep_fused_deep_moe"
    assert p.processor.layout == weights.FUSED_DEEP_MOE_LAYOUT
    assert p.execution_mode(layer.request) == "emulated"
    assert err < TOL[quant], err


def test_fuseep_hands_fused_deep_moe_dense_operands(npu_registry, monkeypatch):
    """fused_deep_moe is a custom op (DeepEP-Ascend) that reads its tensors' memory as laid out:
    the caller's views (rows of a wider buffer, column-major top-k) reach it as dense copies,
    and the result is what contiguous inputs give."""
    layer, _ = _compare(FUSE, "w8a8_int8", npu_registry, t=16)
    runner = layer._fused
    seen = []
    real = runner.ops.fused_deep_moe

    def recording(buffer, x, ids, wts, *rest, **kw):
        seen.append((x.is_contiguous(), ids.is_contiguous(), wts.is_contiguous()))
        return real(buffer, x, ids, wts, *rest, **kw)

    monkeypatch.setattr(runner.ops, "fused_deep_moe", recording)
    _, x, ids, wts = make_problem(FUSE, "w8a8_int8", 16)
    wide = torch.zeros(16, FUSE.hidden_size + 64, dtype=x.dtype)
    wide[:, : FUSE.hidden_size] = x
    got = layer(wide[:, : FUSE.hidden_size], ids.t().contiguous().t(), wts.t().contiguous().t())
    assert torch.equal(got, layer(x, ids, wts))
    assert seen == [(True, True, True)] * 2


def _run_fused(impl, cfg, quant, registry):
    """Build one fused forward directly (as the selection would), with its weight processor."""
    req = BuildRequest(cfg, moehal.QuantScheme.parse(quant), detect("cpu"), registry.settings)
    assert impl.supports(req).ok
    proc = next(p for p in registry.processors if p.layout == impl.weight_layout)
    w, x, ids, wts = make_problem(cfg, quant, 16)
    runner = impl.build(req)
    runner.load(proc.process(w, req))
    ref = MoELayer(cfg, quant, backend="reference", device="cpu", registry=registry)
    ref.load_weights(w)
    return rel_err(runner.forward(x, moehal.TopK(ids, wts), None), ref(x, ids, wts))


def test_fuseep_dispatch_ffn_combine_w8a8(npu_registry):
    impl = next(f for f in npu_registry.fused if f.qualname == "npu.fuseep_dispatch_ffn_combine")
    err = _run_fused(impl, FUSE.with_(routed_scaling_factor=1.5), "w8a8_int8", npu_registry)
    assert err < TOL["w8a8_int8"], err


def _decisions(registry, cfg, quant):
    req = BuildRequest(cfg, moehal.QuantScheme.parse(quant), detect("cpu"), registry.settings)
    _, decisions = moehal.enumerate_pipelines(req, registry, backend="npu")
    return {d.name: d for d in decisions}


def test_fuse_modes_declare_their_quant_schemes(npu_registry):
    """Both fuse modes are W8A8 INT8: FUSED_DEEP_MOE's op definition takes INT8 weights only
    (session 30's audit), DISPATCH_FFN_COMBINE's documentation says so."""
    d = _decisions(npu_registry, FUSE, "bf16")
    fdm = d["npu.fuseep_fused_deep_moe"]
    assert not fdm.ok and "INT8 weights only" in fdm.reason
    dfc = d["npu.fuseep_dispatch_ffn_combine"]
    assert not dfc.ok and "W8A8 INT8 only" in dfc.reason
    assert _decisions(npu_registry, FUSE, "w8a8_int8")["npu.fuseep_fused_deep_moe"].ok
    for scheme in ("fp8_block", "fp8_tensor", "nvfp4"):
        d = _decisions(npu_registry, FUSE, scheme)
        for name in ("npu.gmm", "npu.fuseep_fused_deep_moe", "npu.fuseep_dispatch_ffn_combine"):
            assert not d[name].ok and d[name].predicate == "quant" and scheme in d[name].reason


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden_size": 256}, "hidden_size in [512, 7168]"),
        ({"hidden_size": 528}, "multiple of 32"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 300}, "1..256"),
        ({"intermediate_size": 256}, "gmm1 width"),
        ({"intermediate_size": 768}, "multiple of 1024"),
        ({"top_k": 13, "num_experts": 16}, "top_k <= 12"),
        ({"num_experts": 520, "top_k": 2}, "at most 512 experts"),
        ({"ep_size": 2}, "one rank"),
    ],
)
def test_fused_deep_moe_declines_out_of_limit_shapes(npu_registry, change, needle):
    d = _decisions(npu_registry, FUSE.with_(**change), "w8a8_int8")["npu.fuseep_fused_deep_moe"]
    assert not d.ok and needle in d.reason, d.reason


def test_fp16_is_declined_with_the_reason(npu_registry):
    cfg = SMALL.with_(dtype=torch.float16)
    with pytest.raises(NoBackendError) as exc:
        MoELayer(cfg, "bf16", backend="npu", device="cpu", registry=npu_registry)
    reasons = {d.name: d.reason for d in exc.value.decisions}
    for name in ("npu.gmm", "npu.fuseep_fused_deep_moe", "npu.local_flat", "npu.hccl"):
        assert reasons[name].startswith("Ascend dispatch/combine do not support FP16"), reasons[name]


def test_non_swiglu_and_bias_are_declined(npu_registry):
    d = _decisions(npu_registry, SMALL.with_(activation="gelu"), "bf16")["npu.gmm"]
    assert not d.ok and "SwiGLU" in d.reason
    # a bias (or weight-on-input) decline of a SiLU-gated layer says that alone, not "SwiGLU only"
    d = _decisions(npu_registry, SMALL.with_(has_w13_bias=True), "bf16")["npu.gmm"]
    assert not d.ok and d.reason == "expert biases are not supported"


def test_hccl_dispatcher_needs_ep_and_a_group(npu_registry):
    d = _decisions(npu_registry, SMALL, "bf16")["npu.hccl"]
    assert not d.ok and "ep_size > 1" in d.reason
    d = _decisions(npu_registry, SMALL.with_(ep_size=2, max_tokens=64), "bf16")["npu.hccl"]
    assert not d.ok and "process_group" in d.reason


@pytest.mark.parametrize("torch_version, release", [("2.11.0+cu130", "2.11.0"), ("2.14.0.dev20260101+cpu", "2.14.0")])
def test_without_torch_npu_the_reason_names_the_release_for_this_torch(monkeypatch, torch_version, release):
    """Each torch-npu release pins the torch of its number (2.14.0: `torch==2.14.0.*`): the old
    `npu` extra (`torch-npu>=2.6`) and its hint `pip install moehal[npu]` installed the newest and
    replaced the user's torch (security review 2026-11-29, finding 5). The extra adds nothing
    now, and the backend (doctor's line) and each component name the release for this torch."""
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(plugin, "module_available", lambda name: False)
    want = f'pip install "torch-npu=={release}.*"'
    reason = plugin.available(detect("cpu"), moehal.Settings()).reason
    assert reason.startswith("torch_npu is not installed") and want in reason and torch_version in reason
    assert "moehal[npu]" not in reason and "MOEHAL_EMULATE=npu to emulate" in reason
    monkeypatch.setattr(common, "module_available", lambda name: False)
    req = BuildRequest(SMALL, QuantScheme.parse("bf16"), detect("cpu"), moehal.Settings())
    d = experts.GmmExperts().check_libraries(req)
    assert not d.ok and want in d.reason


def test_without_the_switch_cpu_is_declined_naming_it(plain_registry):
    with pytest.raises(NoBackendError) as exc:
        MoELayer(SMALL, "bf16", backend="npu", device="cpu", registry=plain_registry)
    npu = [d for d in exc.value.decisions if d.name.startswith("npu.") and d.kind != "pipeline"]
    assert npu and all(not d.ok and "MOEHAL_EMULATE=npu" in d.reason for d in npu)
    hw = detect("cpu")
    info = plugin.available(hw, moehal.Settings())
    assert not info.ok and ("torch_npu is not installed" in info.reason or "no Ascend NPU visible" in info.reason)
    assert plugin.available(hw, moehal.Settings(emulate=frozenset({"npu"}))).reason.startswith("emulated mode")


def test_weight_processing_runs_once_with_the_nz_cast(npu_registry, monkeypatch):
    casts = []
    real = ops.VendorOps.format_cast_nz

    def spy(self, t):
        casts.append(tuple(t.shape))
        return real(self, t)

    monkeypatch.setattr(ops.VendorOps, "format_cast_nz", spy)
    w, *_ = make_problem(FUSE, "w8a8_int8", 4)
    layer = MoELayer(FUSE, "w8a8_int8", backend="npu", device="cpu", registry=npu_registry)
    layer.load_weights(w)
    e, h, i = FUSE.num_experts, FUSE.hidden_size, FUSE.intermediate_size
    assert casts == [(e, h, 2 * i), (e, i, h)]  # w13 -> [E,H,2I], w2 -> [E,I,H], each NZ-cast once
    with pytest.raises(moehal.errors.WeightsAlreadyProcessedError):
        layer.process_weights_after_loading()
    assert isinstance(fuseep.FusedDeepMoe(), moehal.FusedForward)


def test_plugin_import_does_not_import_torch_npu():
    code = (
        "import sys, moehal, moehal_npu.plugin; "
        "r = moehal.Registry(moehal.Settings()); r.load_entry_points(); "
        "assert r.plugins['npu'].status == 'loaded', r.plugins['npu']; "
        "assert 'torch_npu' not in sys.modules and 'deep_ep' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("quant", ["bf16", "w8a8_int8"])
def test_zero_tokens_through_the_flat_layout(npu_registry, quant):
    w, x, ids, wts = make_problem(SMALL, quant, 0)
    layer = MoELayer(SMALL, quant, backend="npu", device="cpu", registry=npu_registry)
    layer.load_weights(w)
    out = layer(x, ids, wts)
    assert out.shape == (0, SMALL.hidden_size) and out.dtype == torch.bfloat16


def _deep_ep(monkeypatch, fuse_mode: object | None) -> None:
    """A stand-in `deep_ep` whose `buffer` module has `FuseMode` (a release with fuse modes)
    or not (an earlier one)."""
    import enum
    import importlib.machinery
    import types

    pkg, buf = types.ModuleType("deep_ep"), types.ModuleType("deep_ep.buffer")
    pkg.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None, is_package=True)
    pkg.__path__, pkg.buffer = [], buf
    if fuse_mode is not None:
        buf.FuseMode = enum.IntEnum("FuseMode", {"FUSED_DEEP_MOE": 1, "DISPATCH_FFN_COMBINE": 2})
    monkeypatch.setitem(sys.modules, "deep_ep", pkg)
    monkeypatch.setitem(sys.modules, "deep_ep.buffer", buf)


@pytest.mark.parametrize("has_fuse_modes", [True, False])
def test_fused_deep_moe_calls_each_deep_ep_release_as_it_takes_it(monkeypatch, has_fuse_modes):
    """DeepEP-Ascend releases before fuse modes have no `deep_ep.buffer.FuseMode`, and their
    `fused_deep_moe` takes no `fuse_mode`: FUSED_DEEP_MOE is called without one there, and
    DISPATCH_FFN_COMBINE, which they lack, is declined at build with the reason."""
    _deep_ep(monkeypatch, True if has_fuse_modes else None)
    calls = []

    class Buffer:
        def fused_deep_moe(self, *args, **kw):
            calls.append(kw)
            return args[0], None

    vendor = ops.VendorOps(emulate=False)
    x = torch.zeros(1, 8)
    vendor.fused_deep_moe(Buffer(), x, *([None] * 6), 1, 4, quant_mode=1, fuse_mode=1)
    if has_fuse_modes:
        assert calls[-1]["quant_mode"] == 1 and int(calls[-1]["fuse_mode"]) == 1
    else:
        assert calls[-1] == {"quant_mode": 1}
        with pytest.raises(RuntimeError, match="predates fuse modes"):
            vendor.fused_deep_moe(Buffer(), x, *([None] * 6), 1, 4, quant_mode=1, fuse_mode=2)
    monkeypatch.setattr("moehal_npu.common.module_available", lambda name: True)  # torch_npu "installed"
    req = BuildRequest(FUSE, moehal.QuantScheme.parse("w8a8_int8"), detect("cpu"), moehal.Settings())
    d = fuseep.DispatchFfnCombine().check_libraries(req)
    assert d.ok is has_fuse_modes
    if not has_fuse_modes:
        assert "predates fuse modes" in d.reason


def _npu_req(name: str, cfg: MoEConfig, quant: str = "bf16") -> BuildRequest:
    """A request on a (stand-in) Ascend device of this name, not emulated: the chip rules apply."""
    hw = HardwareInfo("npu", torch.device("cpu"), name)  # torch.device("npu") needs torch_npu
    return BuildRequest(cfg, QuantScheme.parse(quant), hw, process_group=object())


@pytest.mark.parametrize(
    "name,ranks,tokens,hidden,why",
    [
        ("Ascend910B3", 8, 256, 4096, None),  # Atlas A2
        ("Ascend910B3", 4, 64, 4096, "multiples of 8 up to 256"),
        ("Ascend910B3", 8, 512, 4096, "max_tokens <= 256"),
        ("Ascend910_9391", 144, 512, 7168, None),  # Atlas A3
        ("Ascend910_9391", 24, 64, 7168, "EP sizes (8, 16, 32, 64, 128, 144, 256, 288)"),
        ("Ascend910_9391", 16, 64, 4096, "hidden_size 7168 only"),
        ("Ascend950", 16, 512, 4096, "max_tokens <= 256"),  # neither: held to A2's rules
    ],
)
def test_hccl_dispatcher_declines_what_the_ops_tiling_refuses(name, ranks, tokens, hidden, why, monkeypatch):
    """npu_moe_distribute_dispatch's tiling checks (ops-transformer mc2/moe_distribute_dispatch):
    EP sizes, batch bound and hidden size differ between Atlas A2 and A3, read from the device
    name; a shape it refuses is declined at build, not met in the op."""
    from moehal.capability import accept
    from moehal_npu import dispatch
    from moehal_npu.dispatch import HcclDispatcher

    # a stand-in group (no torch.distributed here) that matches the config; checked in test_ep.py
    monkeypatch.setattr(dispatch, "check_process_group", lambda req: accept(predicate="parallel"))

    cfg = MoEConfig(num_experts=ranks * 2, top_k=8, hidden_size=hidden, intermediate_size=1024, max_tokens=tokens)
    req = _npu_req(name, cfg.with_(ep_size=ranks, ep_rank=0))
    d = HcclDispatcher().check_parallel(req)
    d = d if not d.ok else HcclDispatcher().check_shape(req)
    assert d.ok if why is None else (not d.ok and why in d.reason), d.reason
    many = _npu_req("Ascend910B3", cfg.with_(num_experts=8 * 32, ep_size=8, ep_rank=0))  # 32 experts per rank
    d = HcclDispatcher().check_parallel(many)
    assert not d.ok and "at most 24 experts per rank" in d.reason
    d = HcclDispatcher().check_shape(_npu_req("Ascend910_9391", cfg.with_(num_experts=1024, hidden_size=7168)))
    assert not d.ok and "at most 512 experts" in d.reason


def test_w8a8_experts_decline_widths_the_swiglu_quant_op_refuses():
    """npu_dequant_swiglu_quant with group_index takes an output width <= 10496 and a multiple
    of 64 (its documented, checked constraint): Mixtral's 14336 is declined for W8A8, not bf16."""
    from moehal_npu.experts import GmmExperts

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)
    d = GmmExperts().check_shape(_npu_req("Ascend910B3", cfg, "w8a8_int8"))
    assert not d.ok and "<= 10496 and a multiple of 64" in d.reason
    d = GmmExperts().check_shape(_npu_req("Ascend910B3", cfg.with_(intermediate_size=1000), "w8a8_int8"))
    assert not d.ok and "not 1000" in d.reason
    assert GmmExperts().check_shape(_npu_req("Ascend910B3", cfg.with_(intermediate_size=1024), "w8a8_int8")).ok
    assert GmmExperts().check_shape(_npu_req("Ascend910B3", cfg, "bf16")).ok


def test_dispatch_ffn_combine_does_not_claim_to_drop_padding_ids():
    """sgl-kernel-npu's test of DISPATCH_FFN_COMBINE: "Currently, topk=-1 is not supported";
    FUSED_DEEP_MOE's test sends -1 ids. Layers with topk_padding get the other mode."""
    from moehal_npu.fuseep import DispatchFfnCombine, FusedDeepMoe

    assert FusedDeepMoe.drops_padding_ids and not DispatchFfnCombine.drops_padding_ids


def test_fuseep_layers_share_one_low_latency_buffer_per_group_and_shape(monkeypatch):
    """A DeepEP-Ascend low-latency Buffer per layer multiplied the communication buffers by the
    layer count; layers of one shape on one group share one, as SGLang keeps one per process."""
    import types

    made = []

    class Buffer:
        @staticmethod
        def get_low_latency_rdma_size_hint(*args):
            return 1 << 20

        def __init__(self, group, **kw):
            made.append((group, kw))

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=Buffer))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 2)
    monkeypatch.setattr(ops, "_LL_BUFFERS", {})
    vendor, group, other = ops.VendorOps(emulate=False), object(), object()
    first = vendor.low_latency_buffer(group, 16, 7168, 64, 32)
    assert vendor.low_latency_buffer(group, 16, 7168, 64, 32) is first and len(made) == 1
    assert vendor.low_latency_buffer(other, 16, 7168, 64, 32) is not first  # another group
    assert vendor.low_latency_buffer(group, 32, 7168, 64, 32) is not first  # another size
    assert len(made) == 3 and made[0][1] == dict(num_rdma_bytes=1 << 20, low_latency_mode=True, num_qps_per_rank=32)
    assert ops.release_low_latency_buffers() == 3
    assert vendor.low_latency_buffer(group, 16, 7168, 64, 32) is not first and len(made) == 4
