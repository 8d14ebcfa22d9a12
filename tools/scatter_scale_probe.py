"""What do the quantizing scatter's scale stores cost? (a diagnostic for #4's FP8 goal)

The FP8 prefill scatter moves its bytes at about 70% of the copy bandwidth, the bf16 one at
about 85%. The FP8 scatter also writes one fp32 scale per (slot, 1x128 group), MN-major as
DeepGEMM wants it: `scales[e, g, m]`. A program's slots go to different experts' rows, so each
of those 4-byte stores lands in a 32-byte sector of its own. This probe times the scatter
into a masked buffer at a prefill batch three ways:

- `mn-major`: the layer's buffer (DeepGEMM's scale layout);
- `k-major`: the same buffer with its scales stored `[e, m, g]`, so a slot's scales are
  adjacent (the kernel takes any strides; the GEMM could not read this);
- `bf16`: the unquantized scatter, for the bytes it moves.

Each is a CUDA graph of 20 scatters, replayed 10 times; the median per scatter is printed.

    python tools/scatter_scale_probe.py [--shape qwen3_30b_a3b] [--tokens 2048,4096]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch


def graph_us(fn, reps: int = 20, rounds: int = 10) -> float:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b")
    ap.add_argument("--tokens", default="2048,4096")
    args = ap.parse_args()

    import moehal
    from moehal.bench import SHAPES, bench_inputs
    from moehal.kernels.triton_permute import QUANT_GROUP, PaddedBuffer, alloc_padded, bind_permute, masked_rows

    dev = torch.device("cuda")
    cfg = moehal.MoEConfig(**SHAPES[args.shape])
    e, h = cfg.num_local_experts, cfg.hidden_size
    print(torch.cuda.get_device_name(), args.shape)
    for t in (int(v) for v in args.tokens.split(",")):
        x, ids, _ = bench_inputs(cfg, t)
        x, ids = x.to(dev, torch.bfloat16), ids.to(dev, torch.int32)
        m = masked_rows(t)
        fp8 = alloc_padded((e, m), h, torch.float8_e4m3fn, dev, quant=True)
        g = h // QUANT_GROUP
        k_major = torch.zeros(e, m, g, dtype=torch.float32, device=dev)
        fp8_k = PaddedBuffer(fp8.hidden, k_major, fp8.written, fp8.expert_rows.clone(), fp8.counts)
        bf16 = alloc_padded((e, m), h, torch.bfloat16, dev, quant=False)
        variants = (("mn-major", fp8), ("k-major", fp8_k), ("bf16", bf16))
        times = {}
        for name, dest in variants:
            bound = bind_permute(t, cfg.top_k, h, dest, expert_start=0, num_local_experts=e, masked=True)
            times[name] = graph_us(functools.partial(bound, x, ids, None))
            print(f"T={t} {name}: {times[name]:.2f} us per dispatch (positions pass and scatter)", flush=True)
        print(f"T={t}: the MN-major scale stores cost {times['mn-major'] - times['k-major']:.2f} us more")


if __name__ == "__main__":
    main()
