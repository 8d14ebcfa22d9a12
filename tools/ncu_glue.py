"""One eager forward of a layer between cudaProfilerStart/Stop, for Nsight Compute to read the
glue kernels' hardware counters (memory throughput, issue stalls, occupancy) where timing alone
cannot say why a kernel runs below copy bandwidth.

    ncu --clock-control none --profile-from-start off --kernel-name regex:'_scatter|_act|_combine' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 tools/ncu_glue.py --shape qwen3_30b_a3b --tokens 4096 --quant fp8_block

The layer is built and run twice first (Triton compiles, DeepGEMM JITs), so the profiled range
holds one forward's launches only.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import moehal
    from moehal.bench import SHAPES

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--quant", default="bf16")
    p.add_argument("--max-tokens", type=int, default=4096)
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg = moehal.MoEConfig(**SHAPES[a.shape], max_tokens=max(a.tokens, a.max_tokens))
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
    w2 = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=g) / cfg.intermediate_size**0.5
    layer = moehal.MoELayer(cfg, a.quant, device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13.to(dev), w2.to(dev)))
    x = torch.randn(a.tokens, cfg.hidden_size, generator=g).to(dev, cfg.dtype)
    ids = torch.rand(a.tokens, cfg.num_experts, generator=g).argsort(dim=1)[:, : cfg.top_k].to(dev, torch.int32)
    wts = (torch.rand(a.tokens, cfg.top_k, generator=g) + 0.1).to(dev)
    for _ in range(2):
        layer(x, ids, wts)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: {a.shape} {a.quant} T={a.tokens}: {layer.plan.pipeline.name}")
    torch.cuda.profiler.start()
    layer(x, ids, wts)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
