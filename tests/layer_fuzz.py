"""Layer-level differential fuzz: `MoELayer` built from randomly drawn configurations
(hypothesis, derandomized), each forward compared with the reference oracle (`reference_layer`,
conformance's tolerances per quant scheme) and, where the batch is small, with the independent
float64 loop of `moe_testing` fed by a float64 routing written out here. The tests live in
tests/core/test_layer_fuzz.py (every backend that runs on a CPU) and tests/cuda/test_gpu_fuzz.py
(the `cuda` backend on a GPU, at sizes that reach its tuned bands and tile edges).

Backends on a CPU: the reference; ROCm (its Triton experts interpreted under TRITON_INTERPRET=1,
its slow torch fallback anyway); NPU in its explicit emulated mode (`Settings(emulate={'npu'})`,
what MOEHAL_EMULATE=npu sets); and, under the interpreter, the CUDA backend's pieces that run
on a CPU (cuda.permute, and the DeepGEMM experts' Triton glue around the float32 `TorchGemmOps`
stand-in for DeepGEMM's GEMMs, as tests/cuda/test_deepgemm_glue.py drives them), registered as a
stand-in plugin so that `MoELayer` builds them. Every pipeline the backend accepts is drawn
(`pipeline=`), so each layout, dispatcher and fused forward gets its turn; a configuration the
backend declines at build is skipped (`assume`), anything raised at forward is a failure.

Drawn: quant scheme, layer dtype, activation (gated or not, SwiGLU-OAI's alpha and clamp),
biases, routed scaling, router weight on input (top-1), -1 padding ids, router logits (softmax,
sigmoid, DeepSeek-V3 grouped, with or without correction bias and renormalization) or explicit
top-k, an expert-parallel rank's slice in one process (the layer computes that rank's partial
sum: slots of other ranks' experts add nothing), batches over up to three calls of one layer
(or two layers of one shape taking turns, or a deep copy), `out=` (a fresh buffer, a
column-major view, or the input itself), and strided inputs. On a CPU: 1-8 experts, 0 to 17
tokens. On a GPU (`cuda`): 1-256 experts (powers of two and not), top-k up to 10, hidden and
intermediate sizes up to 2048 (some not multiples of 128, which DeepGEMM's FP8 GEMMs decline),
0 to 4096 tokens drawn at the edges of the paths' bands and tiles, layers built for 16384
tokens as an engine builds them, and eager calls replayed from CUDA graphs.
"""

from __future__ import annotations

import copy
import functools
import math
import os

import moehal
import torch
from hypothesis import HealthCheck, assume, note, settings
from hypothesis import strategies as st
from moe_testing import float64_oracle
from moehal.errors import ConfigError, NoBackendError, NotSupportedError, WeightError
from moehal.interfaces import BuildRequest
from moehal.poison import poisoned
from moehal.quant import ALL_SCHEMES, QuantScheme
from moehal.reference.oracle import reference_layer
from moehal.routing import RoutingConfig
from moehal_conformance.tolerances import compare, tolerance_for

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
SCHEMES = {
    "reference": [q.name for q in ALL_SCHEMES],
    "rocm": [q.name for q in ALL_SCHEMES],
    "npu": ["bf16", "w8a8_int8"],
    "cudacpu": ["bf16", "fp8_block", "fp8_block:ue8m0", "fp8_tensor", "nvfp4"],
    "cuda": ["bf16", "bf16", "fp8_block", "fp8_block", "fp8_block:ue8m0", "fp8_tensor", "nvfp4", "w8a8_int8"],
}
# The GPU profile checks batches of up to this many slots, on layers of up to this many weight
# elements (dequantized to float64 on the CPU), against the float64 loop as well.
FLOAT64_LOOP_SLOTS = 256
FLOAT64_LOOP_WEIGHTS = 2**25
# Batch sizes of the GPU profile: the edges of the decode kernels' bands, of 64- and 128-row
# tiles and of the tables' prefill bands (1024-4096). Hypothesis favours a list's first entries
# (its simplest), so a mid-sized batch leads and the empty one comes last (session 47's first
# 280 examples drew 0 tokens for 114 of their calls).
GPU_TOKENS = [17, 1, 2, 3, 5, 8, 9, 16, 31, 33, 64, 65, 127, 129, 255, 257, 511, 513, 1024, 1025, 2048, 4096, 0]
FUZZ = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


@functools.cache
def _registry() -> moehal.Registry:
    """The installed plugins, the NPU backend's emulation switched on explicitly."""
    reg = moehal.Registry(moehal.Settings(emulate=frozenset({"npu"})))
    reg.load_entry_points()
    return reg


@functools.cache
def _cuda_cpu_registry() -> moehal.Registry:
    """The installed plugins and `cudacpu`: cuda.permute and DeepGEMM experts whose GEMMs are
    `TorchGemmOps` (float32, written in the layer dtype as DeepGEMM writes them), on the CPU."""
    from moehal.capability import accept
    from moehal_cuda.deepgemm_experts import (
        DeepGemmExperts,
        DeepGemmExpertsRunner,
        DeepGemmWeightProcessor,
        TorchGemmOps,
    )
    from moehal_cuda.dispatch import CudaPermuteDispatcher
    from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts, Nvfp4DequantProcessor, Nvfp4DequantRunner

    class OnCpu:
        devices = frozenset({"cpu"})

        def check_hardware(self, req):
            return accept("CPU stand-in, Triton glue interpreted", "hardware")

        def check_libraries(self, req):
            return accept(predicate="libraries")

        def _alignment(self) -> int:
            return 128  # DeepGEMM's contiguous-layout row alignment on SM90

        def execution_mode(self, req) -> str:
            return "interpreted"

    class Experts(OnCpu, DeepGemmExperts):
        name = "deepgemm_torch_gemms"

        def build(self, req, fmt):
            gemms = TorchGemmOps(fmt.is_quantized)
            return DeepGemmExpertsRunner(req, fmt, gemms, None, self.small_batch_format(req))

    class Nvfp4Experts(OnCpu, Nvfp4DequantExperts):
        """The NVFP4-on-Hopper experts as they are: their GEMMs are Triton's (interpreted)."""

        name = "deepgemm_nvfp4_dequant_cpu"

        def build(self, req, fmt):
            return Nvfp4DequantRunner(req, fmt, TorchGemmOps(False))

    class Weights(DeepGemmWeightProcessor):
        devices = frozenset({"cpu"})

    class Nvfp4Weights(Nvfp4DequantProcessor):
        devices = frozenset({"cpu"})

    class Plugin:
        @moehal.hookimpl
        def moehal_backend_info(self):
            return moehal.BackendInfo("cudacpu", "0", "the CUDA backend's CPU-runnable pieces")

        @moehal.hookimpl
        def moehal_dispatchers(self):
            return [CudaPermuteDispatcher()]

        @moehal.hookimpl
        def moehal_experts(self):
            return [Experts(), Nvfp4Experts()]

        @moehal.hookimpl
        def moehal_weight_processors(self):
            return [Weights(), Nvfp4Weights()]

    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    reg.register(Plugin(), "cudacpu")
    return reg


@st.composite
def layer_cases(draw, backend: str, schemes: tuple[str, ...] = ()) -> dict:
    """schemes: draw only these of the backend's (`SCHEMES`); empty: all of them."""
    pool = [q for q in SCHEMES[backend] if q in schemes] if schemes else SCHEMES[backend]
    if not pool:
        raise ValueError(f"{backend} fuzzes none of {schemes}; its schemes: {sorted(set(SCHEMES[backend]))}")
    c: dict = {"backend": backend, "quant": draw(st.sampled_from(pool))}
    # mostly what they take
    native = backend in ("cudacpu", "cuda") or (backend == "npu" and draw(st.integers(0, 7)) > 0)
    c["dtype"] = "bfloat16" if native else draw(st.sampled_from(["bfloat16", "bfloat16", "float16", "float32"]))
    act = "silu" if backend == "npu" and native else draw(st.sampled_from(["silu", "gelu", "swiglu_oai", "silu_ng"]))
    c["activation"], c["gated"] = act.removesuffix("_ng"), not act.endswith("_ng")
    if act == "swiglu_oai":
        c["swiglu_alpha"] = draw(st.sampled_from([1.702, 0.5]))
        c["swiglu_limit"] = draw(st.sampled_from([7.0, 0.75, math.inf]))
    bias_ok = not (backend == "npu" and native)
    c["has_w13_bias"] = bias_ok and draw(st.booleans())
    if backend == "cudacpu" and c["quant"] not in ("bf16", "nvfp4"):
        # DeepGEMM writes GEMM1's output in bf16 before the glue adds the w13 bias, so it is
        # rounded twice; with fp8 that may flip GEMM2's input quantization past the tolerance on
        # tiny layers (docs/backends/cuda.md, "A w13 bias is added after DeepGEMM has rounded");
        # on a GPU, `check` skips only the DeepGEMM pipelines of such cases. The NVFP4 experts
        # for Hopper add it in their Triton GEMM's epilogue (since session 50)
        c["has_w13_bias"] = False
    c["has_w2_bias"] = bias_ok and draw(st.booleans())
    wide = backend == "npu" and c["quant"] == "w8a8_int8" and draw(st.booleans())  # FuseEP's sizes
    if wide:
        e, h, i = draw(st.sampled_from([2, 4])), 512, 512
    elif backend == "cudacpu":  # DeepGEMM's K multiples: 64 (bf16), 128 (fp8)
        sizes = [64, 128] if c["quant"] == "bf16" else [128]
        e, h, i = draw(st.integers(1, 6)), draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))
    elif backend == "cuda":  # DeepGEMM compiles per (experts, N, K): a few sizes, reused
        # expert counts that are not powers of two too (Qwen1.5-MoE's 60, 160 as a slice of
        # DeepSeek's 256 would not be, ...): kernels pad expert tables to powers of two
        e = draw(st.sampled_from([8, 1, 2, 3, 4, 6, 16, 32, 60, 64, 128, 160, 256]))
        h, i = draw(st.sampled_from([512, 128, 192, 256, 2048])), draw(st.sampled_from([256, 64, 96, 128, 768]))
    else:
        e = draw(st.integers(1, 8))
        h = draw(st.sampled_from([16, 40, 64, 128, 200]))
        i = draw(st.sampled_from([64, 128] if backend == "npu" else [16, 24, 64, 128]))
    c.update(
        num_experts=e,
        hidden_size=h,
        intermediate_size=i,
        top_k=draw(st.integers(1, min(e, 10 if backend == "cuda" else 4))),
    )
    c["ep_size"] = draw(st.sampled_from([d for d in (1, 1, 2, 3) if e % d == 0]))
    c["ep_rank"] = draw(st.integers(0, c["ep_size"] - 1))
    c["routed_scaling_factor"] = draw(st.sampled_from([1.0, 2.5, -0.5]))
    c["apply_router_weight_on_input"] = c["top_k"] == 1 and draw(st.booleans())
    c["topk_padding"] = draw(st.booleans())
    method = draw(st.sampled_from([None, "softmax", "sigmoid", "deepseek_v3"]))
    c["routing"] = None
    if method == "deepseek_v3":
        n_group = draw(st.sampled_from([g for g in range(1, e + 1) if e % g == 0]))
        least = -(-c["top_k"] // (e // n_group))  # groups that hold top_k experts
        topk_group = draw(st.integers(least, n_group))
        c["routing"] = dict(
            method=method,
            renormalize=draw(st.booleans()),
            n_group=n_group,
            topk_group=topk_group,
            # grouped selection without a bias is refused (RoutingConfig.check)
            has_correction_bias=topk_group < n_group or draw(st.booleans()),
        )
    elif method is not None:
        # sigmoid at top-1 renormalized would weight every token 1.0: refused (RoutingConfig.check)
        renormalize = draw(st.booleans()) and not (method == "sigmoid" and c["top_k"] == 1)
        c["routing"] = dict(method=method, renormalize=renormalize)
    c["logits"] = method is not None and draw(st.booleans())
    c["logits_dtype"] = draw(st.sampled_from(["float32", "layer"]))
    sizes = GPU_TOKENS if backend == "cuda" else [0, 1, 2, 5, 17]
    c["tokens"] = draw(st.lists(st.sampled_from(sizes), min_size=1, max_size=3))
    bound = max(1, *c["tokens"]) + draw(st.sampled_from([0, 3]))  # sizes masked buffers; FuseEP needs one
    c["max_tokens"] = bound if wide or draw(st.booleans()) else None
    if backend == "cuda" and draw(st.integers(0, 3)) == 3:  # (0 is what hypothesis draws most)
        c["max_tokens"] = 16384  # an engine's layer, built for its largest batch (the masked budget)
    c["pad_fraction"] = draw(st.sampled_from([0.3, 1.0])) if c["topk_padding"] else 0.0
    c["ids_dtype"] = draw(st.sampled_from(["int32", "int64"]))
    c["out"] = draw(st.sampled_from(["none", "buffer", "in_place", "column_major"]))
    c["strided_x"] = draw(st.sampled_from(["no", "no", "columns", "rows"]))
    c["calls"] = draw(st.sampled_from(["one_layer", "one_layer", "two_layers", "deep_copy"]))
    c["inference_mode"] = draw(st.booleans())
    c["pipeline"] = draw(st.integers(0, 31))
    c["seed"] = draw(st.integers(0, 2**16))
    c["device"] = "cuda" if backend == "cuda" else "cpu"
    # eager calls of up to this many tokens replay CUDA graphs (`moehal.graphs`)
    c["cuda_graph_tokens"] = draw(st.sampled_from([64, 0, 4096, 0])) if backend == "cuda" else 0
    return c


def _config(c: dict) -> moehal.MoEConfig:
    keys = (
        "num_experts", "top_k", "hidden_size", "intermediate_size", "activation", "gated", "has_w13_bias",
        "has_w2_bias", "routed_scaling_factor", "apply_router_weight_on_input", "ep_rank", "ep_size", "max_tokens",
        "topk_padding", "swiglu_alpha", "swiglu_limit",
    )  # fmt: skip
    kw = {k: c[k] for k in keys if k in c}
    routing = RoutingConfig(**c["routing"]) if c["routing"] else None
    try:
        return moehal.MoEConfig(**kw, dtype=getattr(torch, c["dtype"]), routing=routing)
    except ConfigError:
        assume(False)
        raise


def _route64(logits: torch.Tensor, cfg: moehal.MoEConfig, bias: torch.Tensor | None):
    """Router logits -> (ids, weights) in float64, written out independently of
    `moehal.routing.route`: equal scores go to the lower index; a near tie at the selection
    boundary (which float32 may break the other way) skips the example."""
    r, k, x = cfg.routing, cfg.top_k, logits.double()

    def top(v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        vals, idx = torch.sort(v, dim=-1, descending=True, stable=True)
        if n < v.shape[-1]:
            gap = vals[..., n - 1] - vals[..., n]
            assume(not bool(((gap > 0) & (gap < 1e-5)).any()))
        return vals[..., :n], idx[..., :n]

    if r.method.value == "softmax":
        w, ids = top(torch.softmax(x, -1), k)
    elif r.method.value == "sigmoid":  # chosen on the logits, weighted by their sigmoids
        lk, ids = top(x, k)
        w = torch.sigmoid(lk)
    else:
        s = torch.sigmoid(x)
        choice = s if bias is None else s + bias.double()
        t, e = choice.shape
        groups = choice.view(t, r.n_group, e // r.n_group)
        group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top(group_score, r.topk_group)[1], True)
        allowed = keep[:, :, None].expand_as(groups).reshape(t, e)
        ids = top(choice.masked_fill(~allowed, -math.inf), k)[1]
        w = s.gather(1, ids)
    if r.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w


def _layer_and_oracle(c, cfg, quant, registry, pipe, gen):
    """A layer of `pipe` and the oracle, both loaded with one draw of weights (drawn on the
    case's device)."""
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    dev = gen.device
    w13 = torch.randn(e, cfg.w13_rows, h, generator=gen, device=dev) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen, device=dev) / i**0.5
    b13 = torch.randn(e, cfg.w13_rows, generator=gen, device=dev) * 0.1 if cfg.has_w13_bias else None
    b2 = torch.randn(e, h, generator=gen, device=dev) * 0.1 if cfg.has_w2_bias else None
    has_cb = cfg.routing is not None and cfg.routing.has_correction_bias
    cb = torch.randn(cfg.num_experts, generator=gen, device=dev) * 0.05 if has_cb else None
    calib = torch.randn(8, h, generator=gen, device=dev)
    try:
        weights = moehal.quantize_weights(
            cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, correction_bias=cb, calibration_input=calib
        )
    except WeightError:  # nvfp4's 16-element blocks
        assume(False)
    kept = {name: t.clone() for name, t in weights.tensors().items()}
    try:
        layer = moehal.MoELayer(
            cfg, quant, backend=c["backend"], device=dev, registry=registry, pipeline=pipe,
            cuda_graph_tokens=c.get("cuda_graph_tokens", 0),
        )  # fmt: skip
    except (ConfigError, NotSupportedError, NoBackendError):
        assume(False)
    layer.load_weights(weights)
    for name, t in weights.tensors().items():
        assert torch.equal(t, kept[name]), f"load_weights changed the caller's {name}"
    oracle = reference_layer(cfg, quant, dev, registry=_registry())
    oracle.load_weights(moehal.ExpertWeights(**kept))
    return layer, oracle, moehal.ExpertWeights(**kept), cb


def _weight_elements(cfg: moehal.MoEConfig) -> int:
    return cfg.num_local_experts * cfg.hidden_size * (cfg.w13_rows + cfg.intermediate_size)


def _forward(layer, c, x, args, kwargs):
    """The layer's forward as the case calls it (input layout, `out=`, grad mode); its output."""
    t, h = x.shape
    if c["strided_x"] == "columns":
        x_in = x.clone().t().contiguous().t()
    elif c["strided_x"] == "rows":
        x_in = torch.zeros(t, h + 8, dtype=x.dtype, device=x.device)[:, 3 : 3 + h].copy_(x)
    else:
        x_in = x.clone()
    buf = None
    if c["out"] == "buffer":
        buf = torch.full_like(x, math.nan)
    elif c["out"] == "column_major":
        buf = torch.full((h, t), math.nan, dtype=x.dtype, device=x.device).t()
    elif c["out"] == "in_place":
        buf = x_in
    with torch.inference_mode() if c["inference_mode"] else torch.no_grad():
        out = layer(x_in, *args, **kwargs) if buf is None else layer(x_in, *args, **kwargs, out=buf)
    if buf is not None:
        assert out is buf, "out= must return the caller's buffer"
    else:
        assert torch.equal(x_in, x), "the forward changed hidden_states"
    return out


def check(c: dict) -> str:
    """Build the case's layer(s) and oracle, run its calls, compare every output; the name of
    the pipeline it ran. Fresh allocations hold NaN (integers 1) throughout, as in conformance
    (`moehal.poison`): a read of memory nobody wrote fails every time, not when the allocator
    hands back what an earlier example left."""
    with poisoned():
        return _check(c)


def _check(c: dict) -> str:
    note(repr(c))
    cfg, quant = _config(c), QuantScheme.parse(c["quant"])
    registry = _cuda_cpu_registry() if c["backend"] == "cudacpu" else _registry()
    dev = torch.device(c.get("device", "cpu"))
    req = BuildRequest(cfg, quant, moehal.detect(dev), registry.settings)
    pipes, _ = moehal.enumerate_pipelines(req, registry, c["backend"])
    assume(pipes)
    # mostly the backend's own kernels rather than its slow fallback (ROCm's), now and then any
    own = [p for p in pipes if not p.main.fallback] or pipes
    pipe = own[c["pipeline"] % len(own)] if c["pipeline"] % 4 else pipes[c["pipeline"] % len(pipes)]
    note(pipe.name)
    if c["backend"] == "cuda" and quant.name != "bf16" and cfg.has_w13_bias:
        # the double rounding noted in `layer_cases` (not the NVFP4 experts': Triton GEMMs)
        assume("deepgemm" not in pipe.name or "nvfp4_dequant" in pipe.name)
    gen = torch.Generator(dev).manual_seed(c["seed"])
    layers = 2 if c["calls"] == "two_layers" else 1
    pairs = [_layer_and_oracle(c, cfg, quant, registry, pipe, gen) for _ in range(layers)]
    tol = tolerance_for(quant, cfg.dtype)
    for n, t in enumerate(c["tokens"]):
        if n == 1 and c["calls"] == "deep_copy":
            layer, oracle, weights, cb = pairs[0]
            try:
                pairs[0] = (copy.deepcopy(layer), oracle, weights, cb)
            except NotSupportedError as exc:  # GPU layers: their launches hold their buffers' addresses
                assert dev.type == "cuda" and "cannot be copied" in str(exc), exc
        layer, oracle, weights, cb = pairs[n % len(pairs)]
        x = torch.randn(t, cfg.hidden_size, generator=gen, device=dev).to(cfg.dtype)
        if c["logits"]:
            dt = torch.float32 if c["logits_dtype"] == "float32" else cfg.dtype
            logits = (torch.randn(t, cfg.num_experts, generator=gen, device=dev) * 2).to(dt)
            ids, wts = _route64(logits, cfg, cb)
            args, kwargs = (), {"router_logits": logits}
        else:
            ids = torch.zeros(0, cfg.top_k, dtype=torch.int64, device=dev)
            if t and dev.type == "cpu":
                ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(t)])
            elif t:  # distinct experts per token, without a launch per token
                ids = torch.rand(t, cfg.num_experts, generator=gen, device=dev).argsort(dim=1)[:, : cfg.top_k]
            pad = torch.rand(t, cfg.top_k, generator=gen, device=dev) < c["pad_fraction"]
            ids = torch.where(pad, -1, ids).to(getattr(torch, c["ids_dtype"]))
            wts = torch.rand(t, cfg.top_k, generator=gen, device=dev) + 0.1
            args, kwargs = (ids, wts), {}
        want = oracle(x, *args, **kwargs)
        out = _forward(layer, c, x, args, kwargs)
        assert out.shape == (t, cfg.hidden_size) and out.dtype == cfg.dtype, f"{out.shape} {out.dtype}"
        got = compare(out, want, tol)
        assert got.ok, f"call {n} ({t} tokens), {pipe.name} vs the reference oracle: {got.detail}"
        if dev.type != "cpu" and (t * cfg.top_k > FLOAT64_LOOP_SLOTS or _weight_elements(cfg) > FLOAT64_LOOP_WEIGHTS):
            continue  # the loop runs on the CPU, slot by slot: the oracle alone judges large layers
        cpu = (weights.to("cpu"), x.cpu(), ids.cpu(), wts.double().cpu())
        exact = compare(out.cpu(), float64_oracle(cfg, quant, *cpu), tol)
        assert exact.ok, f"call {n} ({t} tokens), {pipe.name} vs the float64 loop: {exact.detail}"
    return pipe.name
