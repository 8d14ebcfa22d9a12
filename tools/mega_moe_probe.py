"""Does DeepGEMM's SM90 FP8 Mega MoE kernel run on one GPU, is it right, and is it fast?

sgl-deep-gemm 0.1.4.post1 ships `fp8_mega_moe`: dispatch, GEMM1, SwiGLU, GEMM2 and the
weighted combine in one kernel (FP8 activations in 1x128 groups, FP8 weights in 128x128
blocks). It is built for expert parallelism over symmetric memory; with one rank the buffer is
an ordinary allocation. This probe, per shape of `moehal bench` and token count:

- runs `mega_moe_pre_dispatch_sm90` + `fp8_mega_moe` on the bench's weights and routing;
- compares the output with moehal's reference backend (fp8_block, the same block-quantized
  weights): relative error norm, beside moehal's own `cuda` fp8 layer's;
- times it (CUDA-graph replay where it captures, else eager) beside moehal's `cuda` layer in
  fp8_block and bf16, in the same process, as `moehal bench` times them.

    python tools/mega_moe_probe.py [--shapes qwen3_30b_a3b] [--tokens 1,128,2048] [--no-moehal]
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable
from typing import Any

import torch

BLOCK = 128


class MegaMoE:
    """One GPU's `fp8_mega_moe`: buffer, weights and a forward `(x, ids, weights) -> y`."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int) -> None:
        import deep_gemm as dg

        self.dg = dg
        e, n13, h = w13.shape
        i = n13 // 2
        from moehal.quant.fp8 import quantize_block

        self.l1, self.l2 = dg.transform_weights_for_mega_moe_sm90(quantize_block(w13), quantize_block(w2))
        align = dg._C.get_token_alignment_for_mega_moe()
        self.max_tokens = -(-max_tokens // align) * align
        nbytes, slicer = dg._C.get_symm_buffer_size_for_sm90_mega_moe(
            1, e, self.max_tokens, top_k, h, i, True, "swiglu"
        )
        buf = torch.zeros(int(nbytes), dtype=torch.int8, device="cuda")
        views = [torch.from_dlpack(v) if not isinstance(v, torch.Tensor) else v for v in slicer(buf)]
        x, x_sf, idx, wts = views[:4]
        print(
            f"  mega buffer {nbytes / 2**20:.0f} MiB for {self.max_tokens} tokens; x {tuple(x.shape)} {x.dtype}, "
            f"x_sf {tuple(x_sf.shape)} {x_sf.dtype}, topk_idx {tuple(idx.shape)} {idx.dtype}, "
            f"topk_weights {tuple(wts.shape)} {wts.dtype}",
            flush=True,
        )
        self.sym = types.SimpleNamespace(
            buffer=buf,
            handle=types.SimpleNamespace(buffer_ptrs=[buf.data_ptr()]),
            group=types.SimpleNamespace(rank=lambda: 0, size=lambda: 1),
            num_max_tokens_per_rank=self.max_tokens,
            num_experts=e,
            num_topk=top_k,
            x=x.view(torch.float8_e4m3fn) if x.dtype != torch.float8_e4m3fn else x,
            x_sf=x_sf,
            topk_idx=idx,
            topk_weights=wts,
        )

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        s = self.sym
        t = x.shape[0]
        self.dg.mega_moe_pre_dispatch_sm90(
            x, ids.to(torch.int32), wts.float(), s.x, s.x_sf, s.topk_idx, s.topk_weights, t, BLOCK, 1.0
        )
        y = torch.empty(t, x.shape[1], dtype=torch.bfloat16, device=x.device)
        self.dg.fp8_mega_moe(y, self.l1, self.l2, s, None, (BLOCK, BLOCK, BLOCK), "swiglu", None, True)
        return y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def timed_us(fn: Callable[[], Any], dev: torch.device) -> tuple[float, str]:
    from moehal.bench import GRAPH_REPLAYS_PER_SAMPLE, SETTLE_S, _graphed, time_call

    try:
        g = _graphed(fn)
        return time_call(g, dev, 7, warmup_s=SETTLE_S, per_sample=GRAPH_REPLAYS_PER_SAMPLE) * 1e6, "graph"
    except Exception as exc:  # not capturable: eager
        print(f"    (no graph: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})", flush=True)
        torch.cuda.synchronize()
        return time_call(fn, dev, 7, warmup_s=SETTLE_S) * 1e6, "eager"


def row(mega: MegaMoE | None, ref: Any, layers: dict[str, Any], cfg: Any, t: int, dev: torch.device) -> str:
    """One token count: each path's time and its error against the reference."""
    from moehal.bench import bench_inputs

    x, ids, wts = bench_inputs(cfg, t)
    xd, ids, wts = x.to(dev, cfg.dtype), ids.to(dev, torch.int32), wts.to(dev)
    r = ref(xd, ids, wts)
    cells = []
    if mega is not None:
        try:
            err = rel_err(mega(xd, ids, wts), r)
            us, how = timed_us(lambda: mega(xd, ids, wts), dev)
            cells.append(f"mega {us:8.1f} us ({how}) err {err:.4f}")
        except Exception as exc:
            cells.append(f"mega FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    for q, lay in layers.items():
        err = rel_err(lay(xd, ids, wts), r)
        us, how = timed_us(lambda lay=lay: lay(xd, ids, wts), dev)
        cells.append(f"cuda {q} {us:8.1f} us ({how}) err {err:.4f}")
    return f"  T={t:5d}  " + " | ".join(cells)


def shape_rows(shape: str, tokens: list[int], with_moehal: bool, dev: torch.device) -> None:
    import moehal
    from moehal.bench import SHAPES, _weights
    from moehal.quant import QuantScheme
    from moehal.quant.fp8 import dequantize_block, quantize_block
    from moehal.reference.oracle import reference_layer

    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max(tokens))
    w13, w2, _ = _weights(shape, cfg, QuantScheme.parse("fp8_block"), dev)
    print(f"== {shape}: E={cfg.num_experts} H={cfg.hidden_size} I={cfg.intermediate_size} top{cfg.top_k}", flush=True)
    # every path gets the block-quantized weights the mega kernel reads, so only activations differ
    deq13, deq2 = dequantize_block(*quantize_block(w13)), dequantize_block(*quantize_block(w2))
    mega: MegaMoE | None = None
    try:
        mega = MegaMoE(deq13, deq2, cfg.top_k, max(tokens))
    except Exception as exc:
        print(f"  mega: cannot build: {type(exc).__name__}: {exc}", flush=True)
    ref = reference_layer(cfg, "fp8_block", dev, validate=False)
    ref.load_weights(moehal.quantize_weights(cfg, ref.quant, deq13, deq2))
    layers: dict[str, Any] = {}
    if with_moehal:
        for q in ("fp8_block", "bf16"):
            lay = moehal.MoELayer(cfg, q, backend="cuda", device=dev, validate=False)
            lay.load_weights(moehal.quantize_weights(cfg, lay.quant, deq13, deq2))
            layers[q] = lay
            print(f"  cuda {q}: {lay.plan.pipeline.name}", flush=True)
    for t in tokens:
        print(row(mega, ref, layers, cfg, t, dev), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    p.add_argument("--tokens", default="1,16,128,1024,2048,4096")
    p.add_argument("--no-moehal", action="store_true", help="time the mega kernel only")
    a = p.parse_args()
    dev = torch.device("cuda")
    tokens = [int(t) for t in a.tokens.split(",")]
    for shape in a.shapes.split(","):
        shape_rows(shape, tokens, not a.no_moehal, dev)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
