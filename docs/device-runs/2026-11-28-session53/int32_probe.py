"""Session 53: `contiguous_grouped_gemm` on one expert whose 128 live rows lie at the end of a
contiguous buffer of M rows, against torch. Past 2^31 elements (row x K for the input, row x N
for the output) the kernel's int32 row offsets wrapped before the fix.

    python int32_probe.py K N M [K N M ...]
"""

import sys

import torch
from moehal.kernels.triton_grouped_gemm import contiguous_grouped_gemm

args = [int(v) for v in sys.argv[1:]]
for k, n, m in zip(args[0::3], args[1::3], args[2::3]):
    m = m // 128 * 128
    g = torch.Generator().manual_seed(0)
    a = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    a[m - 128 :] = torch.randn(128, k, generator=g).bfloat16().cuda()
    w = (torch.randn(1, n, k, generator=g) / 64).bfloat16().cuda()
    out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    re = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    re[m - 128 :] = 0
    over = [name for name, cols in (("input", k), ("output", n)) if (m - 1) * cols >= 2**31]
    print(f"K={k} N={n} M={m}: past 2^31 elements: {', '.join(over) or 'neither'}", flush=True)
    try:
        contiguous_grouped_gemm(a, w, out, re, 128, torch.tensor([0.5], device="cuda"))
        torch.cuda.synchronize()
    except Exception as exc:  # an illegal address ends the process's CUDA context: stop here
        print("  RAISED", type(exc).__name__, str(exc).splitlines()[0], flush=True)
        sys.exit(1)
    ref = a[m - 128 :].float() @ w[0].float().t() * 0.5
    err = (out[m - 128 :].float() - ref).abs().max().item()
    written = int((out[: m - 128] != 0).any(dim=1).sum())
    print(
        f"  max |out - ref| over the live rows {err:.3g} (|ref| max {ref.abs().max().item():.3g}); "
        f"padding rows written: {written}",
        flush=True,
    )
    del a, out
    torch.cuda.empty_cache()
