"""Problem builders and the independent float64 oracle for tests (no assertions here)."""

from __future__ import annotations

import moehal
import torch
from moehal.quant import QuantKind, QuantScheme, ScaleFormat, fp8, int8, nvfp4


def random_topk(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if t == 0:
        return torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return ids.to(torch.int32), torch.rand(t, k, generator=gen) + 0.1


def random_weights(cfg: moehal.MoEConfig, gen: torch.Generator, scale: float = 1.0):
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(e, cfg.w13_rows, h, generator=gen) * scale / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) * scale / i**0.5
    b13 = torch.randn(e, cfg.w13_rows, generator=gen) * 0.1 if cfg.has_w13_bias else None
    b2 = torch.randn(e, h, generator=gen) * 0.1 if cfg.has_w2_bias else None
    return w13, w2, b13, b2


def build_problem(cfg: moehal.MoEConfig, quant: QuantScheme, t: int, seed: int = 0):
    """(weights, x, ids, topk weights) with weights quantized per `quant`."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2, b13, b2 = random_weights(cfg, gen)
    x = torch.randn(t, cfg.hidden_size, generator=gen)
    weights = moehal.quantize_weights(cfg, quant, w13, w2, w13_bias=b13, w2_bias=b2, calibration_input=x)
    ids, wts = random_topk(t, cfg.num_experts, cfg.top_k, gen)
    return weights, x.to(cfg.dtype), ids, wts


def _qdq(x: torch.Tensor, quant: QuantScheme, static: torch.Tensor | None) -> torch.Tensor:
    k = quant.kind
    if k is QuantKind.BF16:
        return x
    x32 = x.float()
    if k is QuantKind.FP8_BLOCK:
        return fp8.qdq_group(x32, quant.scale_format is ScaleFormat.UE8M0).double()
    if k is QuantKind.FP8_TENSOR:
        return fp8.qdq_tensor(x32, static).double()
    if k is QuantKind.NVFP4:
        return nvfp4.qdq(x32, static).double()
    return int8.qdq_per_token(x32).double()


def _act(h: torch.Tensor, cfg: moehal.MoEConfig) -> torch.Tensor:
    """The activations written out, independently of moehal.activations."""
    if not cfg.gated:
        if cfg.activation is moehal.Activation.SILU:
            return h / (1 + torch.exp(-h))
        return 0.5 * h * (1 + torch.erf(h / 2**0.5))
    i = h.shape[-1] // 2
    g, u = h[..., :i], h[..., i:]
    if cfg.activation is moehal.Activation.SILU:
        return g / (1 + torch.exp(-g)) * u
    if cfg.activation is moehal.Activation.GELU:
        return 0.5 * g * (1 + torch.erf(g / 2**0.5)) * u
    g = torch.minimum(g, torch.tensor(cfg.swiglu_limit, dtype=g.dtype))
    u = u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    return g / (1 + torch.exp(-cfg.swiglu_alpha * g)) * (u + 1)


def float64_oracle(cfg, quant, weights, x, ids, wts) -> torch.Tensor:
    """Loop over tokens and k in float64 on dequantized weights (the scheme's activation
    quantization applied to each expert input and intermediate), with the roundings to the
    layer dtype that `moehal.reference.math` documents and kernels make: the input scaled by
    its router weight, GEMM1's output (with its bias), and the activation's output. Without
    them a quantized scheme's group scales and steps flip on small problems (session 44's
    fuzz: rel_l2 up to 0.13 against the reference on problems the reference computes exactly)."""

    def stored(t: torch.Tensor) -> torch.Tensor:  # what a kernel keeps in the layer dtype
        return t.to(cfg.dtype).double()

    w13, w2 = (w.double() for w in moehal.dequantize_weights(weights, quant))
    b13 = weights.w13_bias.double() if weights.w13_bias is not None else None
    b2 = weights.w2_bias.double() if weights.w2_bias is not None else None
    out = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(cfg.top_k):
            e = int(ids[t, k]) - cfg.local_expert_start
            if not 0 <= e < cfg.num_local_experts:
                continue
            xin, wt = x[t].double(), float(wts[t, k])
            if cfg.apply_router_weight_on_input:
                xin, wt = stored(xin * wt), 1.0
            h = w13[e] @ _qdq(xin, quant, weights.a13_scale)
            if b13 is not None:
                h = h + b13[e]
            y = w2[e] @ _qdq(stored(_act(stored(h), cfg)), quant, weights.a2_scale)
            if b2 is not None:
                y = y + b2[e]
            out[t] += wt * y
    return out * cfg.routed_scaling_factor
