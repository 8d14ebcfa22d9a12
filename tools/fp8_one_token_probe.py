"""Session 48: the open failure of session 47's GPU fuzz, step by step.

Session 47's fuzz drew an fp8_block layer through `cuda.triton` (8 experts, top-6, hidden 2048,
intermediate 64, routed scaling 2.5, one token) that came out at rel_l2 3.8e-2 against the
oracle's tolerance of 0.035 on an H100. This probe

1. draws that case again exactly as `tests/layer_fuzz.py` draws it (the weights come from the
   device's own generator, so a CPU draw is another problem) and saves every input;
2. runs the portable fused MoE's launches one by one on the same weights and compares each
   launch's output with a torch emulation of that one step fed by the launch before it, so the
   first step that differs is named;
3. draws the case again with other seeds (`--seeds N`) and prints each layer's rel_l2 against
   the oracle and the float64 loop, and against the loop with the oracle's own roundings, to
   tell a kernel fault from the case's own quantization noise.

    python tools/fp8_one_token_probe.py --out DIR [--seeds 64]      # on the GPU
    TRITON_INTERPRET=1 python tools/fp8_one_token_probe.py --load DIR/case.pt   # the same steps,
                                                                  # interpreted on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "cuda")]

import layer_fuzz  # noqa: E402
import moehal  # noqa: E402
from moe_testing import float64_oracle  # noqa: E402
from moehal.interfaces import BuildRequest  # noqa: E402
from moehal.quant import QuantScheme, fp8  # noqa: E402
from moehal_conformance.tolerances import compare, tolerance_for  # noqa: E402


def case_dict(seed: int, device: str) -> dict[str, Any]:
    import test_gpu_fuzz  # the pinned dict, as the GPU test holds it

    # on a CPU (a dry run of this probe), the ROCm backend runs the same kernels, interpreted
    backend = "cuda" if device == "cuda" else "rocm"
    return dict(test_gpu_fuzz.SESSION47_FAILURE, seed=seed, device=device, backend=backend)


def draw(c: dict[str, Any]) -> dict[str, Any]:
    """The case's layer, oracle, weights and one call's inputs, drawn in `layer_fuzz._check`'s
    order; the layer's and the oracle's outputs."""
    cfg, quant = layer_fuzz._config(c), QuantScheme.parse(c["quant"])
    registry = layer_fuzz._registry()
    dev = torch.device(c["device"])
    req = BuildRequest(cfg, quant, moehal.detect(dev), registry.settings)
    pipes, _ = moehal.enumerate_pipelines(req, registry, c["backend"])
    own = [p for p in pipes if not p.main.fallback] or pipes
    pipe = own[c["pipeline"] % len(own)] if c["pipeline"] % 4 else pipes[c["pipeline"] % len(pipes)]
    gen = torch.Generator(dev).manual_seed(c["seed"])
    layer, oracle, weights, _ = layer_fuzz._layer_and_oracle(c, cfg, quant, registry, pipe, gen)
    t = c["tokens"][0]
    x = torch.randn(t, cfg.hidden_size, generator=gen, device=dev).to(cfg.dtype)
    ids = torch.rand(t, cfg.num_experts, generator=gen, device=dev).argsort(dim=1)[:, : cfg.top_k]
    pad = torch.rand(t, cfg.top_k, generator=gen, device=dev) < c["pad_fraction"]
    ids = torch.where(pad, -1, ids).to(getattr(torch, c["ids_dtype"]))
    wts = torch.rand(t, cfg.top_k, generator=gen, device=dev) + 0.1
    with torch.no_grad():
        want = oracle(x, ids, wts)
        out = layer(x.clone(), ids, wts)
    return dict(cfg=cfg, quant=quant, pipe=pipe.name, weights=weights, x=x, ids=ids, wts=wts, out=out, want=want)


def float64_loop(d: dict[str, Any]) -> torch.Tensor:
    w = d["weights"].to("cpu")
    return float64_oracle(d["cfg"], d["quant"], w, d["x"].cpu(), d["ids"].cpu(), d["wts"].double().cpu())


def _diff(name: str, got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    g, r = got.float().cpu(), ref.float().cpu()
    bad = (g != r) & ~(g.isnan() & r.isnan())
    rel = (g - r).norm().item() / max(r.norm().item(), 1e-30)
    row = dict(step=name, elements=g.numel(), differ=int(bad.sum()), max_abs=float((g - r).abs().max()), rel_l2=rel)
    print(f"  {name:28s} {row['differ']:6d} of {row['elements']:6d} differ, max |d| {row['max_abs']:.3e}, "
          f"rel_l2 {rel:.3e}")  # fmt: skip
    return row


def steps(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The portable fused MoE's launches one by one (`BoundFusedMoE.__call__`'s order), each
    against a torch emulation of that step fed by the previous launch's own output."""
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.triton_experts import TritonWeightProcessor

    cfg, quant, x, ids, wts = d["cfg"], d["quant"], d["x"], d["ids"], d["wts"]
    dev = x.device
    hw = moehal.detect(dev)
    req = BuildRequest(cfg, quant, hw, moehal.Settings())
    w = TritonWeightProcessor(devices=frozenset({dev.type})).process(d["weights"].to(dev), req)
    t, top_k = x.shape[0], ids.shape[1]
    name = hw.name if hw.kind == "cuda" else None
    configs = k.select_configs(t, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, top_k, "fp8_block",
                               "bf16", name)  # fmt: skip
    print("  tiles:", configs)
    bound = k.bind_fused_moe(t, top_k, w, out_dtype=cfg.dtype, all_local=True, device_name=name, configs=configs)
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    sorted_ids, expert_ids, num_post = bound.align(flat)
    a1, a1_s = bound.quant1(x, None, None)
    rows: list[dict[str, Any]] = []
    q_ref, s_ref = fp8.quantize_group(x.float())
    rows.append(_diff("quant1 scales", a1_s, s_ref))
    rows.append(_diff("quant1 values", a1.float(), q_ref.float()))
    s = t * top_k
    i = cfg.intermediate_size
    inter = torch.empty((s, i), dtype=cfg.dtype, device=dev)
    bound.gemm1(a1, a1_s, inter, None, sorted_ids, expert_ids, num_post)
    deq13 = fp8.dequantize_block(w.w13, w.w13_scale)  # [E, 2I, H]
    deq2 = fp8.dequantize_block(w.w2, w.w2_scale)  # [E, H, I]
    a1_deq = a1.float() * a1_s.repeat_interleave(128, dim=1)[:, : cfg.hidden_size]
    e_of = flat.long()
    h = torch.einsum("sh,snh->sn", a1_deq[torch.arange(s, device=dev) // top_k], deq13[e_of])
    g, u = h[:, :i].to(cfg.dtype).float(), h[:, i:].to(cfg.dtype).float()
    inter_ref = (torch.nn.functional.silu(g) * u).to(cfg.dtype)
    rows.append(_diff("gemm1+silu (bf16)", inter, inter_ref))
    a2, a2_s = bound.quant2(inter, None)
    q2_ref, s2_ref = fp8.quantize_group(inter.float())
    rows.append(_diff("quant2 scales", a2_s, s2_ref))
    rows.append(_diff("quant2 values", a2.float(), q2_ref.float()))
    y = torch.empty((s, cfg.hidden_size), dtype=cfg.dtype, device=dev)
    tw = wts.reshape(-1).float().contiguous()
    bound.gemm2(a2, a2_s, y, tw, sorted_ids, expert_ids, num_post)
    a2_deq = a2.float() * a2_s.repeat_interleave(128, dim=1)[:, :i]
    y_ref = (torch.einsum("si,shi->sh", a2_deq, deq2[e_of]) * tw[:, None]).to(cfg.dtype)
    rows.append(_diff("gemm2 x router weight", y, y_ref))
    # the whole call as the runner makes it, and the chain of emulated steps from the input on
    out = bound(x, ids, wts)
    rows.append(_diff("fused_moe vs its own steps", out, y.float().reshape(t, top_k, -1).sum(1).to(cfg.dtype)))
    h_chain = torch.einsum("sh,snh->sn", fp8.qdq_group(x.float())[torch.arange(s, device=dev) // top_k], deq13[e_of])
    g, u = h_chain[:, :i].to(cfg.dtype).float(), h_chain[:, i:].to(cfg.dtype).float()
    act = (torch.nn.functional.silu(g) * u).to(cfg.dtype).float()
    y_chain = torch.einsum("si,shi->sh", fp8.qdq_group(act), deq2[e_of]) * tw[:, None]
    chain = y_chain.to(cfg.dtype).float().reshape(t, top_k, -1).sum(1).to(cfg.dtype)
    rows.append(_diff("fused_moe vs emulated chain", out, chain))
    rows.append(_diff("gemm1 inter vs chain's act", inter, act.to(cfg.dtype)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--load", type=Path, help="a case.pt this probe saved: its steps, here (CPU: interpreted)")
    ap.add_argument("--seeds", type=int, default=0, help="draw the case again with seeds 0..N-1")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run, the kernels interpreted")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    if a.load:
        saved = torch.load(a.load, weights_only=True)  # tensors, dicts, lists, str: no pickle code
        d = dict(saved, weights=moehal.ExpertWeights(**saved["weights"]))
        d["cfg"] = layer_fuzz._config(saved["case"])
        d["quant"] = QuantScheme.parse(saved["case"]["quant"])
        print("steps on", d["x"].device, "(saved on", saved["device_name"], ")")
        report["steps"] = steps(d)
        print(json.dumps(report, indent=1))
        return
    dev = a.device
    case = case_dict(0, dev)
    d = draw(case)
    tol = tolerance_for(d["quant"], d["cfg"].dtype)
    loop = float64_loop(d)
    print(d["pipe"])
    report["case"] = {
        "pipeline": d["pipe"],
        "vs_oracle": compare(d["out"], d["want"], tol).detail,
        "vs_float64_loop": compare(d["out"].cpu(), loop, tol).detail,
        "oracle_vs_float64_loop": compare(d["want"].cpu(), loop, tol).detail,
    }
    print(json.dumps(report["case"], indent=1))
    torch.save(
        dict(
            case=case, device_name=torch.cuda.get_device_name() if dev == "cuda" else "cpu", x=d["x"].cpu(),
            ids=d["ids"].cpu(), wts=d["wts"].cpu(), out=d["out"].cpu(), want=d["want"].cpu(), loop=loop,
            weights={n: t.cpu() for n, t in d["weights"].tensors().items()},
        ),
        a.out / "case.pt",
    )  # fmt: skip
    print("steps on", dev)
    report["steps"] = steps(d)
    sweep = []
    for s in range(a.seeds):
        ds = draw(case_dict(s, dev))
        loop = float64_loop(ds)
        row = dict(
            seed=s,
            oracle=compare(ds["out"], ds["want"], tol).rel_l2,
            loop=compare(ds["out"].cpu(), loop, tol).rel_l2,
            oracle_vs_loop=compare(ds["want"].cpu(), loop, tol).rel_l2,
        )
        sweep.append(row)
        print(f"seed {s:3d}: vs oracle {row['oracle']:.3e}, vs loop {row['loop']:.3e}, "
              f"oracle vs loop {row['oracle_vs_loop']:.3e}")  # fmt: skip
    report["sweep"] = sweep
    (a.out / "probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
