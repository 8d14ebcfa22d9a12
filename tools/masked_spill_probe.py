"""Does DeepGEMM's masked grouped GEMM write across experts when max_m is a multiple of 64 but
not of 128? (A GPU probe for session 40's audit: DeepGEMM's masked heuristic picks BLOCK_M from
{64, 128} by `expected_m`, and its epilogue stores whole tiles through a 2D descriptor over all
experts' rows, so an expert whose last 128-row tile passes max_m would write into the next
expert's first rows.)

For each max_m, GEMM width and expected_m hint, every expert is filled to (nearly) max_m rows,
the GEMM runs through moehal's own DeepGEMM calls (`DeepGemmOps`, no graph memo) several times,
and each expert's live rows are compared with a float32 reference. A row is wrong when its
relative error exceeds 5%; bf16 rounding stays near 0.5%.

    python3 tools/masked_spill_probe.py [--reps 5]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from moehal_cuda.deepgemm_experts import DeepGemmOps

    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda")
    ops = DeepGemmOps(fp8=False, sm100=False, replay_graphs=False)
    e, k = 4, 2048
    g = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("max_m  n     expected_m  wrong rows per rep (experts 0-3 summed)  verdict")
    for max_m in (64, 192, 256, 320, 384):
        for n in (1024, 4096):
            x = torch.randn(e, max_m, k, device=dev, generator=g).bfloat16()
            w = (torch.randn(e, n, k, device=dev, generator=g) / k**0.5).bfloat16()
            mm = torch.tensor([max_m - 1, max_m, max_m - 1, max_m], dtype=torch.int32, device=dev)
            ref = torch.einsum("emk,enk->emn", x.float(), w.float())
            for em in (16, 64, 128, max_m, 1024):
                wrong = []
                for _ in range(a.reps):
                    d = torch.full((e, max_m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    ops.masked(x, None, w, None, d, mm, em)
                    torch.cuda.synchronize()
                    bad = 0
                    for i in range(e):
                        live = int(mm[i])
                        err = (d[i, :live].float() - ref[i, :live]).norm(dim=1) / ref[i, :live].norm(dim=1)
                        bad += int((~(err < 0.05)).sum())  # NaN counts as wrong
                    wrong.append(bad)
                verdict = "ok" if not any(wrong) else "WRONG"
                print(f"{max_m:5d}  {n:4d}  {em:10d}  {wrong!s:40s}  {verdict}", flush=True)


if __name__ == "__main__":
    main()
