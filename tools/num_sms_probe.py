"""Does DeepGEMM run the prefill layers faster on fewer SMs? (a diagnostic for #4's FP8 goal)

At Qwen3-30B-A3B's 2048-4096 tokens the H100 and H200 run the whole layer at their power cap
(about 700 W), at lower clocks than a short run reaches, and fp8_block sits at 1.45-1.48x the
bf16 layer where #4 asks 1.5x. DeepGEMM's persistent grouped GEMMs launch one CTA per SM
(`deep_gemm.set_num_sms`, default: all of them); on fewer SMs its heuristics pick tiles
again, and the waves and the power per SM change. This probe times the `cuda` layer as
`moehal bench` times a row (a CUDA-graph replay after the row's work settled the clocks), at
several SM counts, interleaved round by round, and prints each row's time and clock.

    python tools/num_sms_probe.py [--shapes qwen3_30b_a3b] [--tokens 2048,4096] [--sms 132,124,116,108]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_30b_a3b")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--quant", default="bf16,fp8_block")
    ap.add_argument("--sms", default="0,124,116,108", help="0: DeepGEMM's default (every SM)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    import deep_gemm
    import moehal
    from moehal.bench import SHAPES, ClockSampler, bench_one, measure_ceilings, release_layers
    from moehal.quant import QuantScheme

    dev = torch.device("cuda")
    every = deep_gemm.get_num_sms()
    sms = [int(s) or every for s in args.sms.split(",")]
    print(torch.cuda.get_device_name(), f"DeepGEMM default SMs: {every}", flush=True)
    registry = moehal.discover()
    sampler = ClockSampler.start(dev)
    ceil = measure_ceilings(dev)
    times: dict[tuple, list[float]] = {}
    clocks: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for shape in args.shapes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=tokens)
                release_layers(dev)
                for q in args.quant.split(","):
                    for n in sms:
                        deep_gemm.set_num_sms(n)
                        row = bench_one(
                            shape, cfg, QuantScheme.parse(q), "cuda", tokens, dev, ceil, args.reps, registry,
                            sampler=sampler, host_columns=False,
                        )  # fmt: skip
                        key = (shape, tokens, q, n)
                        times.setdefault(key, []).append(row.time_us)
                        clocks.setdefault(key, []).append(row.sm_mhz)
                        print(f"round {r} {shape} T={tokens} {q} SMs={n}: {row.time_us:.1f} us, "
                              f"{row.sm_mhz:.0f} MHz", flush=True)  # fmt: skip
    deep_gemm.set_num_sms(every)
    if sampler is not None:
        sampler.close()
    print("\n| shape | tokens | quant | SMs | us (median) | vs all SMs | MHz |")
    print("|---|---|---|---|---|---|---|")
    for (shape, tokens, q, n), ts in times.items():
        base = statistics.median(times[(shape, tokens, q, every)])
        med = statistics.median(ts)
        mhz = statistics.median(clocks[(shape, tokens, q, n)])
        print(f"| {shape} | {tokens} | {q} | {n} | {med:.1f} | {med / base:.3f} | {mhz:.0f} |")
    for shape in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            if ("bf16" in args.quant) and ("fp8_block" in args.quant):
                bf = statistics.median(times[(shape, tokens, "bf16", every)])
                for n in sms:
                    fp = statistics.median(times[(shape, tokens, "fp8_block", n)])
                    print(f"{shape} T={tokens}: fp8_block on {n} SMs vs bf16 on all: {bf / fp:.3f}x")


if __name__ == "__main__":
    main()
