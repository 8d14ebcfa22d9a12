"""A/B of the portable fused MoE's GEMM1 on paired w13 (gate and up rows interleaved: one dot
per K step) against the canonical layout (two dots), in one process, the variants taking turns
(A B A B) on the benchmark's weights and routing, each timed as `moehal bench` times a row
(CUDA-graph replays after `--settle-s` of the same work). Same tiles for both (the shipped
table's, or the heuristic's).

    python3 tools/paired_ab.py [--shape qwen3_30b_a3b] [--tokens 1024,2048,4096] [--rounds 2]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch


def main() -> None:
    from moehal.bench import time_call
    from moehal.graphs import capture
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tune_fused_moe import _problem

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1024,2048,4096")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    print(f"{name}: {a.shape} bf16, settle {a.settle_s} s, graph replays")
    for t in map(int, a.tokens.split(",")):
        x, ids, wts, w, cfg = _problem(a.shape, "bf16", t, dev)
        assert w.w13_paired, "the processor pairs unquantized gated w13"
        i = cfg.intermediate_size
        canon = replace(w, w13=torch.cat([w.w13[:, 0::2], w.w13[:, 1::2]], dim=1).contiguous(), w13_paired=False)
        assert torch.equal(k.pair_gate_up(canon.w13), w.w13)
        variants = {"paired": w, "canonical": canon}

        def run(v, x=x, ids=ids, wts=wts):  # noqa: ANN001, ANN202
            return k.fused_moe(x, ids, wts, v, device_name=name)

        outs = {n: run(v) for n, v in variants.items()}
        err = float((outs["paired"].float() - outs["canonical"].float()).abs().max())
        ref = float(outs["canonical"].float().abs().max())
        graphs = {n: capture(lambda v=v: run(v), dev)[0] for n, v in variants.items()}
        g1, g2 = k.select_configs(t, cfg.num_local_experts, cfg.hidden_size, i, cfg.top_k, "none", "bf16", name)
        print(f"T={t}: tiles {g1.as_dict()} / {g2.as_dict()}")
        print(f"  max|paired - canonical| {err:.3g} (max|y| {ref:.3g})")
        for r in range(a.rounds):
            for n, g in graphs.items():
                us = time_call(g.replay, dev, a.reps, warmup_s=a.settle_s, per_sample=10) * 1e6
                print(f"  round {r + 1} {n:10s} {us:8.1f} us", flush=True)
        del graphs, outs, variants
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
