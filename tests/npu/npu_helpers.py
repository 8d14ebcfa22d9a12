"""Problem builders for the NPU backend tests (no assertions here)."""

from __future__ import annotations

import moehal
import torch


def make_problem(cfg: moehal.MoEConfig, quant: str, t: int, seed: int = 0):
    """(canonical weights, x bf16 [T,H], topk ids int32 [T,K], topk weights fp32 [T,K])."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    weights = moehal.quantize_weights(cfg, moehal.QuantScheme.parse(quant), w13, w2)
    x = torch.randn(t, h, generator=gen).to(cfg.dtype)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(t)]) if t else None
    ids = ids.to(torch.int32) if t else torch.zeros(0, cfg.top_k, dtype=torch.int32)
    wts = torch.rand(t, cfg.top_k, generator=gen) + 0.1
    return weights, x, ids, wts


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the output scale (max |ref|)."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
