"""How the SM100 FlashInfer runners call FlashInfer, on the CPU, against a stand-in `flashinfer`
package whose functions record their arguments and honour the documented layout contracts
(the kernels need SM100; no machine here has one). Each contract below is the vendor's, read
from its source (session 30's audit, docs/device-runs/2026-11-25-session30):

- where each name lives: the CuteDSL masked grouped GEMM in `flashinfer.cute_dsl.blockscaled_gemm`
  (`flashinfer.gemm` in later releases), not at the top level;
- `CuteDslMoEWrapper.run` reads activation block scales in the linear `[T, H/16]` layout;
- the masked grouped GEMM writes its `(m, n, l)` output through its data pointer as `(l, m, n)`
  memory, and the NVFP4 activation quantizer views its `[l, m, 2I]` input flat;
- trtllm-gen applies `routed_scaling_factor` in its DeepSeek-V3 routing only, and always
  renormalizes there.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest
import torch
from moehal.config import MoEConfig
from moehal.formats import ActivationFormat, Layout, MaskedInput, StandardInput
from moehal.hardware import HardwareInfo
from moehal.interfaces import BuildRequest
from moehal.quant import NVFP4, QuantScheme
from moehal.routing import RoutingConfig
from moehal.weights import local_slice, quantize_weights
from moehal_cuda import flashinfer_moe as fm

SM100 = HardwareInfo("cuda", torch.device("cuda", 0), "Test B200", (10, 0))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # find_spec sees it
    m.__path__ = []  # a package: its submodules resolve through sys.modules only
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _as_lmn(out: torch.Tensor) -> torch.Tensor:
    """What the CuteDSL kernel writes: `out`'s memory as contiguous `(l, m, n)`, whatever its
    strides say (it takes the data pointer only, with N innermost)."""
    m, n, groups = out.shape
    return torch.as_strided(out, (groups, m, n), (m * n, n, 1))


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """A `flashinfer` laid out as the releases that keep the masked GEMM in
    `cute_dsl.blockscaled_gemm` (no `flashinfer.gemm` here)."""
    rec = Recorder()

    def record(name: str, result: Any = None) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            rec.calls.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result

        return fn

    def fp4_quantize(x: torch.Tensor, gs: torch.Tensor, sf_vec_size: int = 16, **kw: Any) -> tuple:
        if not x.is_contiguous():  # CHECK_CONTIGUOUS(self) in its fp4Quantize.cpp
            raise RuntimeError("fp4_quantize: self must be contiguous")
        t, h = x.shape
        rows = t if not kw.get("is_sf_swizzled_layout", True) else -(-t // 128) * 128
        return torch.zeros(t, h // 2, dtype=torch.uint8), torch.zeros(rows, h // sf_vec_size, dtype=torch.uint8)

    class Wrapper:
        def __init__(self, **kwargs: Any) -> None:
            rec.calls.append(("CuteDslMoEWrapper", (), kwargs))
            self.hidden = kwargs["hidden_size"]

        def run(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            rec.calls.append(("CuteDslMoEWrapper.run", (x, *args), kwargs))
            return torch.zeros(x.shape[0], self.hidden, dtype=torch.bfloat16)

    def grouped_gemm_nt_masked(lhs: tuple, rhs: tuple, out: torch.Tensor, masked_m: torch.Tensor, **kw: Any) -> None:
        rec.calls.append(("grouped_gemm_nt_masked", (lhs, rhs, out, masked_m), kw))
        a = lhs[0]
        m, n, groups = out.shape
        if a.dim() == 3 and a.shape[0] == groups and a.dtype == torch.bfloat16:  # GEMM2: act rows from the quantizer
            cols = torch.arange(n) % a.shape[2]
            _as_lmn(out).copy_(a[:, :, cols])
        else:  # GEMM1: a pattern of (expert, row, column)
            e, r, c = torch.meshgrid(torch.arange(groups), torch.arange(m), torch.arange(n), indexing="ij")
            _as_lmn(out).copy_((e * 64 + r * 8 + c % 7).to(out.dtype))  # (<= 256: exact in bf16)

    def silu_quantize(x: torch.Tensor, masked_m: torch.Tensor, gs: torch.Tensor) -> tuple:
        rec.calls.append(("silu_and_mul_scaled_nvfp4_experts_quantize", (x, masked_m, gs), {}))
        x.view(-1, x.shape[-1])  # as FlashInfer does: a non-contiguous input raises here
        return x[..., : x.shape[-1] // 2].clone(), torch.zeros(1)

    def grouped_quantize(x: torch.Tensor, masked_m: torch.Tensor, gs: torch.Tensor) -> tuple:
        rec.calls.append(("scaled_fp4_grouped_quantize", (x, masked_m, gs), {}))
        return torch.zeros(1, dtype=torch.uint8), torch.zeros(1)

    def trtllm(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(args[2].shape[0], args[2].shape[1], dtype=torch.bfloat16)

    fused = _module(
        "flashinfer.fused_moe",
        CuteDslMoEWrapper=Wrapper,
        trtllm_fp8_block_scale_moe=record("trtllm_fp8_block_scale_moe", trtllm),
        trtllm_fp8_per_tensor_scale_moe=record("trtllm_fp8_per_tensor_scale_moe", lambda *a, **k: [trtllm(*a, **k)]),
    )
    cute = _module(
        "flashinfer.cute_dsl",
        scaled_fp4_grouped_quantize=grouped_quantize,
        silu_and_mul_scaled_nvfp4_experts_quantize=silu_quantize,
    )
    blockscaled = _module("flashinfer.cute_dsl.blockscaled_gemm", grouped_gemm_nt_masked=grouped_gemm_nt_masked)
    top = _module("flashinfer", fp4_quantize=record("fp4_quantize", fp4_quantize), fused_moe=fused, cute_dsl=cute)
    for mod in (top, fused, cute, blockscaled):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delitem(sys.modules, "flashinfer.gemm", raising=False)
    monkeypatch.setattr(fm, "flashinfer_version", lambda: "0.6.8")  # softmax routing's first release
    fm._fi.cache_clear()
    yield rec
    fm._fi.cache_clear()


def _cfg(**kw: Any) -> MoEConfig:
    return MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, **kw)


def _nvfp4_weights(cfg: MoEConfig):
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g)
    return quantize_weights(cfg, NVFP4, w13, w2, calibration_input=torch.randn(8, 256, generator=g))


def test_names_resolve_from_the_modules_each_release_keeps_them_in(fake_flashinfer, monkeypatch):
    req = BuildRequest(_cfg(), NVFP4, SM100)
    masked = fm.CuteDslNvfp4MaskedExperts()
    assert masked.check_libraries(req).ok  # grouped_gemm_nt_masked from cute_dsl.blockscaled_gemm
    assert (
        fm._fi("grouped_gemm_nt_masked") is sys.modules["flashinfer.cute_dsl.blockscaled_gemm"].grouped_gemm_nt_masked
    )
    # a later release: the GEMM in flashinfer.gemm, blockscaled_gemm gone
    fm._fi.cache_clear()
    newer = _module("flashinfer.gemm", grouped_gemm_nt_masked=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "flashinfer.gemm", newer)
    monkeypatch.delitem(sys.modules, "flashinfer.cute_dsl.blockscaled_gemm")
    assert masked.check_libraries(req).ok and fm._fi("grouped_gemm_nt_masked") is newer.grouped_gemm_nt_masked
    # neither: declined, saying where it looked
    monkeypatch.delitem(sys.modules, "flashinfer.gemm")
    d = masked.check_libraries(req)
    assert (
        not d.ok
        and "lacks ['grouped_gemm_nt_masked']" in d.reason
        and "flashinfer.cute_dsl.blockscaled_gemm" in d.reason
    )


def test_cutedsl_standard_runner_quantizes_activations_with_linear_scales(fake_flashinfer):
    cfg = _cfg(max_tokens=64)
    req = BuildRequest(cfg, NVFP4, SM100)
    runner = fm.CuteDslStandardRunner(req, ActivationFormat(Layout.STANDARD, cfg.dtype))
    runner.load(fm.prepare_cutedsl_nvfp4(_nvfp4_weights(cfg), standard=True))
    ids = torch.tensor([[0, 3], [1, -1], [2, 1]], dtype=torch.int32)
    inp = StandardInput(torch.randn(3, 256).bfloat16(), None, ids, torch.rand(3, 2))
    assert runner.apply(inp).hidden.shape == (3, 256)
    # the caller's hidden_states may be a view of wider rows (conformance's strided_inputs)
    wide = torch.randn(3, 320).bfloat16()
    assert runner.apply(StandardInput(wide[:, :256], None, ids, torch.rand(3, 2))).hidden.shape == (3, 256)
    (_, kw), (strided, _) = fake_flashinfer.named("fp4_quantize")
    assert torch.equal(strided[0], wide[:, :256]) and strided[0].is_contiguous()
    assert kw["is_sf_swizzled_layout"] is False and kw["sf_vec_size"] == 16
    (args, _), _ = fake_flashinfer.named("CuteDslMoEWrapper.run")
    assert args[1].shape == (3, 256 // 16)  # one scale row per token: the wrapper gathers rows
    assert torch.equal(args[2], torch.tensor([[0, 3], [1, 0], [2, 1]], dtype=torch.int32))  # remote -> local 0
    assert args[3][1, 1] == 0  # ... with weight 0
    ((_, ctor),) = fake_flashinfer.named("CuteDslMoEWrapper")
    assert ctor["max_num_tokens"] == 64 and ctor["use_cuda_graph"] is True


@pytest.mark.parametrize("max_tokens", [None, 64])
def test_cutedsl_standard_runner_copies_out_of_a_preallocating_wrapper(fake_flashinfer, monkeypatch, max_tokens):
    """Releases whose wrapper preallocates for CUDA graphs (flashinfer 0.6: `_moe_output`, sized
    by `max_num_tokens`, 4096 when not given) return a view of that buffer, which the next call
    overwrites, and raise on larger batches. The runner returns a tensor of its own, and runs
    larger batches in pieces of the rows the buffer holds."""

    class Preallocating:
        def __init__(self, **kw: Any) -> None:
            self.max_num_tokens = kw.get("max_num_tokens", 4096)
            self._moe_output = torch.zeros(self.max_num_tokens, kw["hidden_size"], dtype=torch.bfloat16)
            self.rows: list[int] = []

        def run(self, x: torch.Tensor, x_sf: torch.Tensor, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
            t = ids.shape[0]
            if t > self.max_num_tokens:
                raise ValueError(f"num_tokens ({t}) exceeds max_num_tokens ({self.max_num_tokens})")
            self.rows.append(t)
            out = self._moe_output[:t]
            out.copy_(ids[:, :1].to(out.dtype).expand(t, out.shape[1]))  # row r: token r's first expert
            return out

    monkeypatch.setattr(sys.modules["flashinfer.fused_moe"], "CuteDslMoEWrapper", Preallocating)
    fm._fi.cache_clear()
    cfg = _cfg(max_tokens=max_tokens)
    runner = fm.CuteDslStandardRunner(BuildRequest(cfg, NVFP4, SM100), ActivationFormat(Layout.STANDARD, cfg.dtype))
    runner.load(fm.prepare_cutedsl_nvfp4(_nvfp4_weights(cfg), standard=True))

    def call(ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[0]
        return runner.apply(StandardInput(torch.randn(t, 256).bfloat16(), None, ids, torch.rand(t, 2))).hidden

    first = call(torch.tensor([[1, 0], [2, 0]], dtype=torch.int32))
    kept = first.clone()
    call(torch.tensor([[3, 0], [3, 1]], dtype=torch.int32))
    assert torch.equal(first, kept)  # the second call left the first result alone
    assert first.untyped_storage().data_ptr() != runner.wrapper._moe_output.untyped_storage().data_ptr()
    cap = runner.wrapper.max_num_tokens
    assert cap == (max_tokens or 4096)
    t = cap * 2 + 5  # past the buffer: in pieces, every row in place
    ids = torch.stack([torch.arange(t) % 4, torch.zeros(t, dtype=torch.long)], 1).int()
    runner.wrapper.rows.clear()
    y = call(ids)
    assert runner.wrapper.rows == [cap, cap, 5]
    assert torch.equal(y[:, 0], (torch.arange(t) % 4).to(y.dtype)) and y.shape == (t, 256)


def test_cutedsl_standard_runner_sends_remote_slots_to_no_local_expert(fake_flashinfer):
    """Under expert parallelism, slots routed to another rank (-1) get a global id outside this
    rank's experts, which the wrapper's routing (`moe_sort`) skips: no GEMM rows for them,
    where a local id with weight 0 would pile (R-1)/R of all slots onto one expert."""
    cfg = _cfg(ep_size=2, ep_rank=1)  # experts 2 and 3 live here
    req = BuildRequest(cfg, NVFP4, SM100)
    runner = fm.CuteDslStandardRunner(req, ActivationFormat(Layout.STANDARD, cfg.dtype))
    runner.load(fm.prepare_cutedsl_nvfp4(local_slice(_nvfp4_weights(_cfg()), cfg), standard=True))
    ids = torch.tensor([[0, 1], [1, -1], [-1, -1]], dtype=torch.int32)  # local ids
    runner.apply(StandardInput(torch.randn(3, 256).bfloat16(), None, ids, torch.rand(3, 2)))
    ((args, _),) = fake_flashinfer.named("CuteDslMoEWrapper.run")
    assert torch.equal(args[2], torch.tensor([[2, 3], [3, 0], [0, 0]], dtype=torch.int32))
    ((_, ctor),) = fake_flashinfer.named("CuteDslMoEWrapper")
    assert ctor["local_expert_offset"] == 2 and ctor["num_local_experts"] == 2


def test_cutedsl_masked_runner_keeps_outputs_expert_major(fake_flashinfer):
    cfg = _cfg()
    req = BuildRequest(cfg, NVFP4, SM100)
    runner = fm.CuteDslMaskedRunner(req, ActivationFormat(Layout.MASKED, cfg.dtype))
    runner.load(fm.prepare_cutedsl_nvfp4(_nvfp4_weights(cfg), standard=False))
    e, m = 4, 8
    masked_m = torch.tensor([3, 0, 8, 5], dtype=torch.int32)
    out = runner.apply(MaskedInput(torch.randn(e, m, 256).bfloat16(), None, masked_m, 4, 16)).hidden
    gemms = fake_flashinfer.named("grouped_gemm_nt_masked")
    assert len(gemms) == 2
    for args, kw in gemms:  # logical (m, n, l) over (l, m, n) memory
        assert args[2].permute(2, 0, 1).is_contiguous() and kw["c_dtype"] == "bfloat16"
    # GEMM1's pattern, through the activation's gate half and GEMM2, lands where it belongs
    i = cfg.intermediate_size
    ex, row, col = torch.meshgrid(torch.arange(e), torch.arange(m), torch.arange(256), indexing="ij")
    want = (ex * 64 + row * 8 + (col % i) % 7).float()
    live = (torch.arange(m)[None, :] < masked_m[:, None])[..., None]
    assert out.shape == (e, m, 256)
    assert torch.equal(out.float(), torch.where(live, want, 0.0))


@pytest.mark.parametrize(
    "routing,kernel_scale,folded",
    [
        (RoutingConfig("softmax"), 1.0, 2.5),  # the kernel ignores the factor: folded into GEMM2's scales
        (RoutingConfig("softmax", renormalize=False), 1.0, 2.5),
        (RoutingConfig("deepseek_v3", n_group=2, topk_group=2, has_correction_bias=True), 2.5, 1.0),
    ],
    ids=["renormalize", "softmax", "deepseek_v3"],
)
@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_tensor"])
def test_trtllm_routed_scaling_is_applied_once(fake_flashinfer, routing, kernel_scale, folded, scheme):
    cfg = _cfg(routing=routing, routed_scaling_factor=2.5)
    quant = QuantScheme.parse(scheme)
    req = BuildRequest(cfg, quant, SM100)
    g = torch.Generator().manual_seed(4)
    calib = torch.randn(8, 256, generator=g)
    w = quantize_weights(cfg, quant, torch.randn(4, 256, 256, generator=g), torch.randn(4, 256, 128, generator=g),
                         calibration_input=calib)  # fmt: skip
    impl = fm.TrtllmFp8BlockMoE() if scheme == "fp8_block" else fm.TrtllmFp8TensorMoE()
    proc = fm.TrtllmFp8BlockProcessor() if scheme == "fp8_block" else fm.TrtllmFp8TensorProcessor()
    assert impl.check_routing(req).ok
    prepared = proc.process(w, req)
    if scheme == "fp8_block":
        torch.testing.assert_close(prepared.w2_scale, w.w2_scale.float() * folded)
    else:
        torch.testing.assert_close(prepared.out2_scale, (w.a2_scale * w.w2_scale).float() * folded)
    runner = impl.build(req)
    runner.load(prepared)
    y = runner.forward(torch.randn(3, 256).bfloat16(), None, torch.randn(3, 4))
    assert y.shape == (3, 256) and y.dtype == cfg.dtype  # (fp8_tensor's stand-in returns a list, as 0.8 will)
    ((args, kw),) = fake_flashinfer.named(impl._fn)
    assert args[15] == kernel_scale
    deepseek = routing.method.value == "deepseek_v3"
    assert args[10:12] == ((2, 2) if deepseek else (0, 0))  # n_group, topk_group
    assert kw["routing_method_type"] == (2 if deepseek else 1 if routing.renormalize else 0)


def test_trtllm_declines_deepseek_routing_without_renormalizing():
    cfg = _cfg(
        routing=RoutingConfig("deepseek_v3", n_group=2, topk_group=1, renormalize=False, has_correction_bias=True)
    )
    d = fm.TrtllmFp8BlockMoE().check_routing(BuildRequest(cfg, QuantScheme.parse("fp8_block"), SM100))
    assert not d.ok and "norm_topk_prob" in d.reason


def _trtllm_req(cfg: MoEConfig) -> BuildRequest:
    return BuildRequest(cfg, QuantScheme.parse("fp8_block"), SM100)


@pytest.mark.parametrize("renormalize", [True, False])
def test_trtllm_softmax_routing_needs_the_routing_refactor(monkeypatch, renormalize):
    """Before flashinfer 0.6.8, Default routing raised at the first forward and Renormalize
    picked wrong experts for all-negative logits (flashinfer issue #2822): a decline, with
    the reason, on those releases; DeepSeek-V3 routing is not gated."""
    req = _trtllm_req(_cfg(routing=RoutingConfig("softmax", renormalize=renormalize)))
    monkeypatch.setattr(fm, "flashinfer_version", lambda: "0.6.7")
    d = fm.TrtllmFp8BlockMoE().check_routing(req)
    assert not d.ok and d.predicate == "routing" and "0.6.8" in d.reason and "#2822" in d.reason
    deepseek = _trtllm_req(_cfg(routing=RoutingConfig("deepseek_v3", n_group=2, topk_group=2)))
    assert fm.TrtllmFp8BlockMoE().check_routing(deepseek).ok
    monkeypatch.setattr(fm, "flashinfer_version", lambda: "0.6.8rc1")  # a candidate of 0.6.8 is not 0.6.8
    assert not fm.TrtllmFp8BlockMoE().check_routing(req).ok
    monkeypatch.setattr(fm, "flashinfer_version", lambda: "0.6.8")
    assert fm.TrtllmFp8TensorMoE().check_routing(req).ok


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(num_experts=6), "num_experts % 4"),
        (dict(num_experts=4, top_k=4), "num_experts > top_k"),
        (dict(num_experts=64, top_k=11, routing=RoutingConfig("softmax")), "top_k <= 10"),
        (dict(num_experts=16, top_k=9, routing=RoutingConfig("deepseek_v3", n_group=2, topk_group=2)), "top_k <= 8"),
        (
            dict(
                num_experts=64,
                top_k=8,
                routing=RoutingConfig("deepseek_v3", n_group=8, topk_group=5, has_correction_bias=True),
            ),
            "topk_group <= 4",
        ),
        # 2 of 8 groups of 4 experts: 8 reachable, and the launcher wants top_k strictly below that
        (
            dict(
                num_experts=32,
                top_k=8,
                routing=RoutingConfig("deepseek_v3", n_group=8, topk_group=2, has_correction_bias=True),
            ),
            "top_k <",
        ),
    ],
    ids=["experts%4", "experts<=topk", "softmax topk>10", "topk>8", "topk_group>4", "unreachable"],
)
def test_trtllm_routing_limits_decline_at_build(monkeypatch, kw, why):
    """The routing kernel's launcher asserts these at the first forward: moehal declines them
    at build, so another pipeline runs instead of a RuntimeError mid-serving."""
    monkeypatch.setattr(fm, "flashinfer_version", lambda: "0.6.8")
    base = dict(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, routing=RoutingConfig("softmax"))
    cfg = MoEConfig(**{**base, **kw})
    d = fm.TrtllmFp8BlockMoE().check_routing(_trtllm_req(cfg))
    assert not d.ok and d.predicate == "routing" and why in d.reason, d.reason
    # DeepSeek-V3's own shape passes
    ok = MoEConfig(
        256, 8, 256, 128, routing=RoutingConfig("deepseek_v3", n_group=8, topk_group=4, has_correction_bias=True)
    )
    assert fm.TrtllmFp8BlockMoE().check_routing(_trtllm_req(ok)).ok


@pytest.mark.parametrize(
    "method,given,bf16_ok,sent",
    [
        (fm.ROUTING_RENORMALIZE, torch.float32, True, torch.float32),  # rounding could change the top-k
        (fm.ROUTING_DEFAULT, torch.float32, True, torch.float32),
        (fm.ROUTING_RENORMALIZE, torch.bfloat16, True, torch.bfloat16),
        (fm.ROUTING_RENORMALIZE, torch.float16, True, torch.float32),  # fp32 holds fp16 exactly
        (fm.ROUTING_DEEPSEEK_V3, torch.bfloat16, True, torch.bfloat16),  # flashinfer 0.6.8+
        (fm.ROUTING_DEEPSEEK_V3, torch.bfloat16, False, torch.float32),  # older: fp32 only
        (fm.ROUTING_DEEPSEEK_V3, torch.float32, True, torch.float32),
    ],
)
def test_trtllm_logits_keep_their_precision_where_the_launcher_takes_it(method, given, bf16_ok, sent):
    """fp32 router logits reach the softmax routings as fp32 (flashinfer PR #2534, in every
    release those routings run on here): two experts whose fp32 logits differ below bf16's
    resolution keep their order, which rounding to bf16 would turn into a tie."""
    logits = torch.tensor([[1.0, 1.0 + 2**-10, -1.0, 0.5]]).to(given)
    got = fm.logits_for_kernel(logits, method, bf16_ok)
    assert got.dtype == sent
    torch.testing.assert_close(got, logits.to(sent))
    if given == torch.float32 and sent == torch.float32:
        assert got[0, 1] > got[0, 0]  # the order the layer's router computed


@pytest.mark.parametrize("routing", [RoutingConfig("softmax"), RoutingConfig("deepseek_v3", n_group=2, topk_group=2)])
def test_trtllm_logits_reach_the_kernel_contiguous_and_version_is_read_at_build(fake_flashinfer, monkeypatch, routing):
    """The launcher reads logits densely from their data pointer (it checks dtype and shape
    only): strided logits are made contiguous. The flashinfer version is read when the layer
    is built, not at every forward (a package-metadata lookup)."""
    cfg = _cfg(routing=routing)
    req = _trtllm_req(cfg)
    w = quantize_weights(cfg, QuantScheme.parse("fp8_block"), torch.randn(4, 256, 256), torch.randn(4, 256, 128))
    reads = []
    monkeypatch.setattr(fm, "flashinfer_version", lambda: reads.append(1) or "0.6.8")
    runner = fm.TrtllmFp8BlockMoE().build(req)
    runner.load(fm.TrtllmFp8BlockProcessor().process(w, req))
    built = len(reads)
    logits = torch.randn(4, 3).t()  # [3 tokens, 4 experts], transposed storage
    for _ in range(2):
        runner.forward(torch.randn(3, 256).bfloat16(), None, logits)
    assert len(reads) == built
    for args, _ in fake_flashinfer.named("trtllm_fp8_block_scale_moe"):
        got = args[0]
        assert got.is_contiguous() and got.shape == (3, 4)
        torch.testing.assert_close(got.float(), logits.to(got.dtype).float())


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.6.7", False),
        ("0.6.8", True),
        ("0.7.0", True),
        # pre-releases sort before their release (the digits alone read 0.6.7rc2 as 0.6.72)
        ("0.6.7rc2", False),
        ("0.6.8rc1", False),
        ("0.6.8.dev20260301", False),
        ("0.6.8.post1", True),
        ("0.6.8+cu130", True),
        ("0.6.10", True),
        ("not-a-version", False),
    ],
)
def test_trtllm_bf16_deepseek_logits_start_at_flashinfer_0_6_8(monkeypatch, version, ok):
    """trtllm-gen's DeepSeek-V3 routing takes bf16 logits from flashinfer 0.6.8
    (`FLASHINFER_BF16_LOGITS`): older releases, their pre-releases included, get them as fp32."""
    monkeypatch.setattr(fm, "flashinfer_version", lambda: version)
    assert fm.bf16_logits_ok() is ok
    sent = fm.logits_for_kernel(torch.zeros(2, 8, dtype=torch.bfloat16), fm.ROUTING_DEEPSEEK_V3, fm.bf16_logits_ok())
    assert sent.dtype == (torch.bfloat16 if ok else torch.float32)


@pytest.mark.parametrize(
    "version,dg_version,why",
    [("0.4.9", "0.1.3", "older than"), ("0.5.0rc3", "0.1.4rc1", "older than"), ("nightly", "nightly", "not a version")],
)
def test_releases_before_the_minimum_are_declined_with_the_reason(monkeypatch, version, dg_version, why):
    """The minimum-release gates of FlashInfer and DeepGEMM read PEP 440 versions: a release
    candidate of the minimum is older than it, and an unreadable version is declined as such."""
    from moehal_cuda import support

    monkeypatch.setattr(fm, "module_available", lambda name: True)
    monkeypatch.setattr(fm, "flashinfer_version", lambda: version)
    d = fm.flashinfer_decision(["trtllm_fp8_block_scale_moe"])
    assert not d.ok and d.predicate == "libraries" and why in d.reason and version in d.reason
    monkeypatch.setattr(support, "module_available", lambda name: True)
    monkeypatch.setattr(support, "package_version", lambda dist: dg_version)
    d = support.deep_gemm_decision(("m_grouped_bf16_gemm_nt_masked",))
    assert not d.ok and d.predicate == "libraries" and why in d.reason and dg_version in d.reason
