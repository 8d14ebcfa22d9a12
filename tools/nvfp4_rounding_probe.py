"""Session 49: where the NVFP4-on-Hopper experts' distance from the oracle came from.

Reads a `case.pt` that `tools/fuzz_case_probe.py` wrote on a GPU for an nvfp4 case through
`cuda.deepgemm_nvfp4_dequant` (top-1 layers), and recomputes each call in float64 with one
rounding switched on or off at a time, against the float64 loop and the kernel's own output:

- `weights_bf16`: the dequantized weights (codes x block scale / global scale) rounded to bf16;
- `x_bf16`: the quantize-dequantized GEMM1 input rounded to bf16;
- `act_bf16`: the quantize-dequantized activation rounded to bf16;
- `double`: operands as codes x block scales (exact in bf16), GEMM outputs rounded to bf16 and
  then scaled by 1 / (global scales) and rounded again (what a bf16-only GEMM allows);
- `single`: the same operands, each GEMM's output scaled in fp32 and rounded once (the fix).

    python tools/nvfp4_rounding_probe.py --load case.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS)]

import layer_fuzz  # noqa: E402
import moehal  # noqa: E402
from moe_testing import float64_oracle  # noqa: E402
from moehal.quant import QuantScheme, nvfp4  # noqa: E402


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def variant(cfg: moehal.MoEConfig, w: moehal.ExpertWeights, call: dict, mode: str) -> torch.Tensor:
    """The call's output in float64 with the roundings `mode` names (module docstring)."""
    x, (ids, wts) = call["x"], call["args"]
    out = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(cfg.top_k):
            e = int(ids[t, k]) - cfg.local_expert_start
            if not 0 <= e < cfg.num_local_experts:
                continue
            if mode in ("double", "single"):
                w13 = nvfp4.block_values(w.w13[e], w.w13_scale[e]).double()
                w2 = nvfp4.block_values(w.w2[e], w.w2_scale[e]).double()
                xin = nvfp4.block_values(*nvfp4.quantize(x[t : t + 1].float(), w.a13_scale)).double()
                c1 = 1 / (w.a13_scale.double() * w.w13_global_scale[e].double())
                c2 = 1 / (w.a2_scale.double() * w.w2_global_scale[e].double())
            else:
                w13 = nvfp4.dequantize(w.w13[e], w.w13_scale[e], w.w13_global_scale[e]).double()
                w2 = nvfp4.dequantize(w.w2[e], w.w2_scale[e], w.w2_global_scale[e]).double()
                if mode == "weights_bf16":
                    w13, w2 = _bf(w13), _bf(w2)
                xin = nvfp4.qdq(x[t : t + 1].float(), w.a13_scale).double()
                xin = _bf(xin) if mode == "x_bf16" else xin
                c1 = c2 = torch.tensor(1.0, dtype=torch.float64)
            p1 = (xin @ w13.T).float().double()
            h = _bf(_bf(p1) * c1) if mode == "double" else _bf((p1 * c1).float().double())
            a = _bf(h / (1 + torch.exp(-h))).float()
            if mode in ("double", "single"):
                ain = nvfp4.block_values(*nvfp4.quantize(a, w.a2_scale)).double()
            else:
                ain = nvfp4.qdq(a, w.a2_scale).double()
                ain = _bf(ain) if mode == "act_bf16" else ain
            p2 = (ain @ w2.T).float().double()
            y = _bf(_bf(p2) * c2) if mode == "double" else _bf((p2 * c2).float().double())
            if w.w2_bias is not None:
                y = _bf(y + w.w2_bias[e].double())
            out[t] += float(wts[t, k]) * y[0]
    return out * cfg.routed_scaling_factor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", type=Path, required=True)
    a = ap.parse_args()
    d = torch.load(a.load, weights_only=True)  # tensors, dicts, lists, str: no pickle code
    cfg, quant = layer_fuzz._config(d["case"]), QuantScheme.parse(d["case"]["quant"])
    if cfg.gated or cfg.activation is not moehal.Activation.SILU or cfg.has_w13_bias:
        raise SystemExit("this probe recomputes non-gated SiLU layers without a w13 bias")
    for n, call in enumerate(d["calls"]):
        w = moehal.ExpertWeights(**d["weights"][call["layer"]])
        loop = float64_oracle(cfg, quant, w, call["x"], call["args"][0], call["args"][1].double())
        out, want = call["out"].double(), call["want"].double()
        print(f"call {n} ({call['x'].shape[0]} tokens): kernel vs loop {_rel(out, loop):.3e}, "
              f"oracle vs loop {_rel(want, loop):.3e}")  # fmt: skip
        for mode in ("exact", "weights_bf16", "x_bf16", "act_bf16", "double", "single"):
            v = variant(cfg, w, call, mode)
            print(f"  {mode:13s} vs loop {_rel(v, loop):.3e}, vs kernel {_rel(v, out):.3e}")


if __name__ == "__main__":
    main()
