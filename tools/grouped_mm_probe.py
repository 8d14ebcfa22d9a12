"""Could torch's own grouped GEMM (`torch._grouped_mm`, CUTLASS on SM90) carry the bf16 prefill
GEMMs? (a diagnostic for #4's 1024-4096-token roofline goal)

DeepGEMM 0.1.4's contiguous grouped GEMM needs every expert's rows padded to 128: at
Qwen3-30B-A3B's 4096 tokens (about 256 rows per expert) that is about 20% more rows than the
routing sends. `torch._grouped_mm` takes the experts' row ends as offsets, with no padding.
This times, per cell, GEMM1 ([rows, hidden] x [hidden, 2 x intermediate]) and GEMM2
([rows, intermediate] x [intermediate, hidden]) both ways on the same `ROTATIONS` routings,
each as a CUDA graph of one launch per routing (`moehal_cuda.tuning.time_graph`):

- `dg`: DeepGEMM's contiguous GEMM on 128-row padded segments (what the layer does now);
- `gmm`: `torch._grouped_mm` on the unpadded rows.

It prints useful TFLOP/s (the routed rows' FLOPs only), as a share of the dense bf16 rate
measured in the same run, and the largest difference between the two outputs on the routed rows.

    python tools/grouped_mm_probe.py [--shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b]
        [--tokens 256,1024,2048,4096]
"""

from __future__ import annotations

import argparse

import torch
from moehal.bench import SHAPES, measure_ceilings
from moehal_cuda.support import dg_fn, import_deep_gemm
from moehal_cuda.tuning import ROTATIONS, routing_counts, time_graph

ALIGN = 128  # DeepGEMM's contiguous segment alignment (get_mk_alignment_for_contiguous_layout)


def operands(counts: torch.Tensor, k: int, dev: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The unpadded rows with their offsets, and the same rows in 128-row padded segments."""
    rows = int(counts.sum())
    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    a_pad = torch.zeros(int(padded.sum()), k, device=dev, dtype=torch.bfloat16)
    layout = torch.full((a_pad.shape[0],), -1, device=dev, dtype=torch.int32)
    src = dst = 0
    for e, (c, p) in enumerate(zip(counts.tolist(), padded.tolist())):
        a_pad[dst : dst + c] = a[src : src + c]
        layout[dst : dst + c] = e
        src, dst = src + c, dst + p
    offs = torch.cumsum(counts.to(dev), 0).to(torch.int32)
    return {"a": a, "offs": offs, "a_pad": a_pad, "layout": layout, "pad_rows": layout >= 0}


def cell(dg_contig: object, e: int, n: int, k: int, tokens: int, top_k: int, dev: torch.device) -> dict[str, float]:
    gen = torch.Generator(device=dev).manual_seed(tokens + n)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5
    wt = w.transpose(1, 2)  # [E, K, N] with K contiguous: the column-major B that grouped_mm takes
    ops = [operands(c, k, dev, gen) for c in routing_counts(tokens, e, top_k, ROTATIONS)]
    outs_g = [torch.empty(o["a"].shape[0], n, device=dev, dtype=torch.bfloat16) for o in ops]
    outs_d = [torch.empty(o["a_pad"].shape[0], n, device=dev, dtype=torch.bfloat16) for o in ops]

    def gmm(i: int) -> None:
        outs_g[i].copy_(torch._grouped_mm(ops[i]["a"], wt, offs=ops[i]["offs"]))

    def gmm_out(i: int) -> torch.Tensor:
        return torch._grouped_mm(ops[i]["a"], wt, offs=ops[i]["offs"])

    def dg(i: int) -> None:
        dg_contig(ops[i]["a_pad"], w, outs_d[i], ops[i]["layout"])  # type: ignore[operator]

    t_dg = time_graph([lambda i=i: dg(i) for i in range(len(ops))])
    t_gmm = time_graph([lambda i=i: gmm_out(i) for i in range(len(ops))])  # no copy: the kernel alone
    for i in range(len(ops)):
        dg(i)
        gmm(i)
    torch.cuda.synchronize()
    diff = max(float((outs_g[i].float() - outs_d[i][ops[i]["pad_rows"]].float()).abs().max()) for i in range(len(ops)))
    scale = max(float(outs_d[i][ops[i]["pad_rows"]].float().abs().max()) for i in range(len(ops)))
    rows = sum(o["a"].shape[0] for o in ops) / len(ops)
    pad = sum(o["a_pad"].shape[0] for o in ops) / len(ops)
    flops = 2.0 * rows * n * k
    return {"dg_us": t_dg, "gmm_us": t_gmm, "flops": flops, "pad": pad / rows, "diff": diff / max(scale, 1e-9)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="256,1024,2048,4096")
    args = p.parse_args()
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    rate = ceil.matmul_flops_per_s / 1e12
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dense bf16 {rate:.0f} TFLOP/s")
    dg_contig = dg_fn(import_deep_gemm(), "m_grouped_bf16_gemm_nt_contiguous")
    print("| shape | tokens | GEMM | padded | DeepGEMM us (%) | grouped_mm us (%) | gmm / dg | rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        e, h, i, k = s["num_experts"], s["hidden_size"], s["intermediate_size"], s["top_k"]
        for t in (int(x) for x in args.tokens.split(",")):
            for label, n, kk in (("w13", 2 * i, h), ("w2", h, i)):
                r = cell(dg_contig, e, n, kk, t, k, dev)
                pct = lambda us, r=r: r["flops"] / (us * 1e-6) / 1e12 / rate * 100  # noqa: E731
                print(
                    f"| {name} | {t} | {label} | {r['pad']:.2f}x | {r['dg_us']:.1f} ({pct(r['dg_us']):.0f}%) | "
                    f"{r['gmm_us']:.1f} ({pct(r['gmm_us']):.0f}%) | {r['gmm_us'] / r['dg_us']:.2f} | {r['diff']:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
