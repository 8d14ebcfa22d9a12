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
    from glue_sweep import random_case  # tools/ is this script's directory

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--quant", default="bf16")
    p.add_argument("--max-tokens", type=int, default=4096)
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg, w13, w2, x, ids, wts = random_case(a.shape, a.tokens, max(a.tokens, a.max_tokens), dev)
    layer = moehal.MoELayer(cfg, a.quant, device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13.to(dev), w2.to(dev)))
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
