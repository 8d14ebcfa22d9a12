"""Whole-layer time of batches run as the portable Triton fused MoE (token-major:
`DeepGemmExperts.portable_prefill_min_tokens`, and for fp8_tensor
`DeepGemmExperts.fp8_tensor_portable_max_tokens`) against the pipeline otherwise chosen (masked or
contiguous grouped GEMMs with the permute, activation and combine passes), per benchmark shape
and token count: the measurements `GemmChooser.portable_prefill_range` decides by.

    python3 tools/portable_prefill_probe.py [--cases qwen3_30b_a3b:64,...,4096 mixtral_8x7b:1024 ...] \\
        [--quant bf16|fp8_block|fp8_tensor] [--rounds 2] [--settle-s 2] [--json out.json --source docs/...]

Both variants are built on the same weight tensors (the portable kernel reads the grouped
GEMMs' own), captured into CUDA graphs and timed in turns, `--rounds` times each, every timing
after `--settle-s` seconds of the same replays (as `moehal bench` times its rows: a shorter
settle can end inside an H100's power-limiter transient). The record keeps each variant's
fastest round. The two outputs are compared too (relative max difference; both are bf16 sums
of the same products in different orders, and for fp8 the activations are quantized by each
path in its own kernels), so a wrong kernel cannot win on time.
`--json` writes `"prefill_portable"` records (`tools/merge_tuned.py` merges them).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--cases",
        nargs="+",
        default=[
            "qwen3_30b_a3b:64,128,256,512,1024,2048,4096",
            "deepseek_v3_ep8:256,1024,4096",
            "mixtral_8x7b:256,1024,4096",
        ],
        help="SHAPE:TOKENS,... (benchmark shapes of moehal.bench.SHAPES)",
    )
    p.add_argument("--quant", default="bf16", choices=("bf16", "fp8_block", "fp8_tensor"))
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--json", default=None)
    p.add_argument("--source", default="", help="where the log of this run is kept (written into the records)")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    records: dict[str, dict] = {}
    for case in a.cases:
        shape, tokens = case.split(":")
        for t in (int(x) for x in tokens.split(",")):
            key, current, portable = probe_case(shape, t, max(t, a.max_tokens), a.rounds, a.settle_s, a.quant)
            torch.cuda.empty_cache()
            rec = records.setdefault(key, {"source": a.source, "layer_us": {}})
            rec["layer_us"][str(t)] = {"current": round(current, 1), "portable": round(portable, 1)}
            if a.json:  # after every case: a time limit keeps what was measured
                with open(a.json, "w") as f:
                    json.dump({"meta": _meta(a.settle_s), "prefill_portable": records}, f, indent=1)


def _meta(settle_s: float) -> dict:
    from moehal_cuda.tuning import _meta as tuning_meta

    meta = tuning_meta(torch.cuda.get_device_name())
    meta["method"] = (
        f"whole layer, CUDA-graph replays after {settle_s} s of replays, variants in turns "
        "(tools/portable_prefill_probe.py)"
    )
    return meta


@functools.lru_cache(maxsize=1)
def _case_weights(shape: str, max_tokens: int, quant: str) -> tuple:
    """A shape's config and quantized random weights on the GPU, made once for all its token
    counts (Mixtral's are 3.8 GB of host randn)."""
    import moehal
    from glue_sweep import random_case

    dev = torch.device("cuda")
    cfg, w13, w2, *_ = random_case(shape, 1, max_tokens, dev)
    return cfg, moehal.quantize_weights(cfg, moehal.QuantScheme.parse(quant), w13.to(dev), w2.to(dev))


# the outputs of the two paths may differ by this much (relative max difference): bf16 sums in
# another order; for fp8 also an activation value rounded to the next fp8 step by one path only
MAX_DIFF = {"bf16": 2e-2, "fp8_block": 5e-2, "fp8_tensor": 5e-2}


def probe_case(
    shape: str, t: int, max_tokens: int, rounds: int, settle_s: float, quant: str = "bf16"
) -> tuple[str, float, float]:
    import moehal
    from glue_sweep import random_case  # tools/ is this script's directory
    from graph_trace import replay_us
    from moehal.bench import settle
    from moehal.graphs import capture
    from moehal_cuda.deepgemm_experts import DeepGemmExperts
    from moehal_cuda.gemm_choice import layer_key

    dev = torch.device("cuda")
    cfg, weights = _case_weights(shape, max_tokens, quant)
    _, _, _, x, ids, wts = random_case(shape, t, max_tokens, dev, weights=False)
    layers = {}
    # fp8_tensor's portable band is a bound from one token up (`fp8_tensor_portable_max_tokens`),
    # the other schemes' a lower bound (`portable_prefill_min_tokens`); 0 turns either off
    static = quant == "fp8_tensor"
    attr = "fp8_tensor_portable_max_tokens" if static else "portable_prefill_min_tokens"
    old = getattr(DeepGemmExperts, attr)
    try:
        for name, value in (("current", 0), ("portable", 1 << 30 if static else 1)):
            setattr(DeepGemmExperts, attr, value)
            layer = moehal.MoELayer(cfg, quant, device=dev, validate=False)
            layer.load_weights(weights)
            layers[name] = layer
    finally:
        setattr(DeepGemmExperts, attr, old)
    graphs, outs = {}, {}
    for name, layer in layers.items():
        graphs[name], outs[name] = capture(lambda layer=layer: layer(x, ids, wts), dev, warmup=1)
        graphs[name].replay()  # a captured output holds nothing until a replay writes it
    torch.cuda.synchronize()
    ref = outs["current"].float()
    diff = ((outs["portable"].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    us: dict[str, list[float]] = {name: [] for name in graphs}
    t0 = time.monotonic()
    for _ in range(rounds):
        for name, graph in graphs.items():
            settle(graph.replay, dev, seconds=settle_s, batch=4)
            us[name].append(replay_us(graph, samples=7, per_sample=5))
    best = {name: min(v) for name, v in us.items()}
    pipe = layers["current"].plan.pipeline.name
    print(
        f"{shape:16s} {quant} T={t:5d}  current {best['current']:8.1f} us  portable {best['portable']:8.1f} us"
        f"  x{best['current'] / best['portable']:.3f}  rel diff {diff:.2e}  rounds {us}"
        f"  ({time.monotonic() - t0:.0f} s; current = {pipe})",
        flush=True,
    )
    if diff > MAX_DIFF[quant]:
        raise SystemExit(f"{shape} T={t}: the portable output differs from the pipeline's by {diff:.2e}")
    key = layer_key(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.gated, quant)
    return key, best["current"], best["portable"]


if __name__ == "__main__":
    main()
