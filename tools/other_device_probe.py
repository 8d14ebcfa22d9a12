"""A layer on `cuda:1` called while `cuda:0` is current (session 38), on a machine with two GPUs.

`MoELayer` makes its device current while a forward queues (`moehal.stream_order`). This probe
runs one layer's forwards (1, 16 and 32 tokens) both ways against the CPU oracle:

- `ordered`: as shipped;
- `unordered`: with the layer's order taken away (`layer._order = None`), as every forward ran
  before session 38, in a child process, since a kernel fault ends a process's CUDA context.

    python tools/other_device_probe.py [--backend cuda]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch


def run(backend: str, ordered: bool) -> int:
    import moehal
    from moehal.reference.oracle import reference_layer

    torch.cuda.set_device(0)
    cfg = moehal.MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256, max_tokens=32)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(16, cfg.w13_rows, 512, generator=g) / 512**0.5
    w2 = torch.randn(16, 512, 256, generator=g) / 256**0.5
    weights = moehal.quantize_weights(cfg, moehal.QuantScheme.parse("bf16"), w13, w2)
    layer = moehal.MoELayer(cfg, "bf16", backend=backend, device="cuda:1")
    layer.load_weights(weights.to("cuda:1"))
    ref = reference_layer(cfg, "bf16", "cpu")
    ref.load_weights(weights)
    if not ordered:
        layer._order = None
    how = "ordered" if ordered else "unordered"
    print(f"{how}: {layer.plan.pipeline.name}; current device {torch.cuda.current_device()}, layer on cuda:1")
    bad = 0
    for t in (1, 16, 32):
        x = torch.randn(t, 512, generator=g).bfloat16()
        w, ids = torch.rand(t, 16, generator=g).topk(4, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        want = ref(x, ids.int(), w)
        try:
            y = layer(x.to("cuda:1"), ids.int().to("cuda:1"), w.to("cuda:1")).float().cpu()
            err = ((y - want.float()).abs().max() / want.float().abs().max()).item()
            verdict = "matches" if err < 3e-2 else "WRONG"
            print(f"  {how} {t:>2} tokens: max error / max |oracle| = {err:.3g} ({verdict})")
            bad += err >= 3e-2
        except Exception as exc:  # noqa: BLE001 - the probe reports what happened
            print(f"  {how} {t:>2} tokens: raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return 2
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--unordered-here", action="store_true", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"needs two CUDA devices; this machine has {torch.cuda.device_count()}")
        return 1
    if args.unordered_here:
        return run(args.backend, ordered=False)
    rc = run(args.backend, ordered=True)
    child = subprocess.run([sys.executable, __file__, "--backend", args.backend, "--unordered-here"], check=False)
    print(f"ordered: rc {rc}; unordered (child process): rc {child.returncode} (0 right, 1 wrong, 2 raised)")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
