"""Where do non-zero padding rows come from after a contiguous batch shrinks? (The intermittent
GPU failure of tests/cuda/test_deepgemm_glue.py::test_contiguous_padding_rows_stay_zero_when_a_batch_shrinks.)

Runs cuda.permute -> the DeepGEMM experts' glue (torch stand-in GEMMs) over a batch of 12 then
one of 7 tokens, many times, and counts non-zero padding rows in each buffer: the dispatched
input, the activation and the GEMM2 output. Usage: python tools/contiguous_padding_probe.py [reps]"""

from __future__ import annotations

import sys

import torch
from moehal.config import MoEConfig
from moehal.formats import ActivationFormat, Layout, ScaleKind
from moehal.hardware import detect
from moehal.interfaces import BuildRequest
from moehal.quant import QuantScheme
from moehal.routing import TopK
from moehal.weights import quantize_weights
from moehal_cuda.deepgemm_experts import DeepGemmExpertsRunner, TorchGemmOps
from moehal_cuda.dispatch import CudaPermuteDispatcher


def main(
    reps: int, twice: bool = False, combine: bool = False, weights: str = "ones", quant_name: str = "bf16"
) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: run with TRITON_INTERPRET=1
    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=256, intermediate_size=128, max_tokens=12)
    quant = QuantScheme.parse(quant_name)
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(8, 256, 256, generator=g) / 16, torch.randn(8, 256, 128, generator=g) / 11
    w = quantize_weights(cfg, quant, w13, w2, calibration_input=torch.randn(16, 256, generator=g))
    req = BuildRequest(cfg, quant, detect(dev))
    fmt = ActivationFormat(Layout.CONTIGUOUS, torch.bfloat16, row_alignment=8)
    if quant_name != "bf16":
        kind = ScaleKind.STATIC_TENSOR if quant_name == "fp8_tensor" else ScaleKind.GROUP_128
        fmt = ActivationFormat(Layout.CONTIGUOUS, torch.float8_e4m3fn, kind, 8)
    bad = {"input": 0, "h": 0, "act": 0, "y": 0}
    for rep in range(reps):
        disp = CudaPermuteDispatcher().build(req, fmt)
        if w.a13_scale is not None:
            disp.load_input_scale(w.a13_scale.reshape(1).float().to(dev))
        ex = DeepGemmExpertsRunner(req, fmt, TorchGemmOps(fmt.is_quantized), None)
        ex.load(w.to(dev))
        snaps = []
        for t in (12, 7):
            x = torch.randn(t, 256, generator=g).bfloat16().to(dev)
            ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(t)]).int().to(dev)
            wts = torch.ones(t, 3) if weights == "ones" else torch.rand(t, 3, generator=g) + 0.1
            topk = TopK(ids, wts.to(dev))
            inp, handle = disp.dispatch(x, topk)
            out = ex.apply(inp)
            ab0 = ex._buffers((inp.hidden.shape[0],), inp.hidden.device)[1]
            snaps.append((ab0.hidden.float().cpu().clone(), ab0.written.cpu().clone()))
            if combine:
                disp.combine(out, handle)
            if twice:  # the test dispatches and applies each call again (its out= check)
                inp2, handle2 = disp.dispatch(x, topk)
                buf = torch.empty(t, 256, dtype=torch.bfloat16, device=dev)
                disp.combine_into(ex.apply_into(inp2, buf), handle2, buf)
        if dev == "cuda":
            torch.cuda.synchronize()
        m = inp.hidden.shape[0]
        r = torch.arange(m, device=dev)
        e = inp.row_expert.long()
        c = e.clamp(min=0)
        live = (e >= 0) & (r - inp.segment_start.long()[c] < inp.counts.long()[c])
        hb, ab, yb = ex._buffers((m,), inp.hidden.device)
        for name, buf in (("input", inp.hidden), ("h", hb.hidden), ("act", ab.hidden), ("y", out.hidden)):
            n = int((buf[~live].float().abs().amax(-1) > 0).sum())
            if n:
                bad[name] += 1
                if name == "act" and bad[name] == 1:  # was each such row live in call 0, and is its bit set?
                    rows = torch.nonzero((buf.float().abs().amax(-1) > 0) & ~live).flatten().tolist()[:4]
                    nchunk = ab0.written.numel() // m
                    for row in rows:
                        same = torch.equal(snaps[0][0][row], buf[row].float().cpu())
                        print(
                            f"  act row {row}: equals call 0's: {same}; bits after call 0 "
                            f"{snaps[0][1][row * nchunk : (row + 1) * nchunk].tolist()}, after call 1 "
                            f"{snaps[1][1][row * nchunk : (row + 1) * nchunk].tolist()}; "
                            f"non-zero cols {torch.nonzero(buf[row].float().cpu()).flatten().tolist()[:6]}"
                        )
                if bad[name] <= 3:
                    rows = torch.nonzero((buf.float().abs().amax(-1) > 0) & ~live).flatten().tolist()
                    print(
                        f"rep {rep}: {name}: {n} non-zero padding rows {rows[:8]}; rows {m}, "
                        f"row_expert {e.tolist()}, counts {inp.counts.tolist()}"
                    )
    print(
        f"{quant_name} twice={twice} combine={combine} weights={weights}: reps with non-zero padding rows:",
        bad,
        f"of {reps}",
    )


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    flags = set(sys.argv[2:])
    q = next((f for f in flags if f in ("fp8_block", "fp8_tensor")), "bf16")
    if "slow" in flags:  # every launch through JITFunction.run, not moehal's fast launcher
        from moehal.kernels import launch

        launch.ENABLED = False
    main(
        n,
        twice="twice" in flags,
        combine="combine" in flags,
        weights="rand" if "rand" in flags else "ones",
        quant_name=q,
    )
