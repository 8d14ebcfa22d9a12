# GPU-only check of _token_gemm_combine_kernel's SPLIT>1 hand-off (triton_token_moe.py:193-203):
# dumps the PTX order of partial stores / barrier / atomic, then re-runs the same launch many
# times and counts results that are not bitwise equal to the first one.
import re, torch
from moehal.kernels import triton_token_moe as M
E, K, H, I = 128, 8, 2048, 768
dev = "cuda"
torch.manual_seed(0)
w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
for t, split in [(1, 4), (4, 4), (8, 2)]:
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(t)]).int()
    act = torch.randn(t * K, I, device=dev).bfloat16()
    wts = torch.rand(t, K, device=dev)
    out = torch.empty(t, H, device=dev, dtype=torch.bfloat16)
    L = M.bind_token_gemm_combine(act, ids, wts, w2, None, out, split=split)
    for _ in range(3):
        L(act, ids, wts, out)
    ref = out.clone()
    res = []
    for i in range(4000):
        L(act, ids, wts, out)
        res.append(out.clone())
    torch.cuda.synchronize()
    r = torch.stack(res)
    bad = (r != ref).flatten(1).any(1).sum().item()
    print(f"t={t} split={split}: {bad}/4000 calls differ bitwise from the first", flush=True)
kern = [e[5] for e in M._token_gemm_combine_kernel._cache.values()]
for k in kern[:1]:
    ptx = k.asm["ptx"]
    lines = ptx.splitlines()
    keep = [f"{i}: {l.strip()}" for i, l in enumerate(lines)
            if re.search(r"bar\.sync|barrier|st\.global|red\.|atom\.|fence|membar|ld\.global\.cg|ld\.global\.L1::no", l)]
    print(k.metadata.num_warps, "warps;", len(keep), "interesting PTX lines (last 40):")
    print("\n".join(keep[-40:]))
