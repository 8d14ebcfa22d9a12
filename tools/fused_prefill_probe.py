"""Whole-layer time of bf16 prefill with GEMM1 run as the fused Triton GEMM1 + activation
kernel (tile given here) instead of what the tuned table picks (DeepGEMM's GEMM1, then the
activation kernel): the tables compare plain GEMM1s only, so at prefill sizes they never
weigh the activation kernel that fusion removes.

    python3 tools/fused_prefill_probe.py [--shapes qwen3_30b_a3b] [--tokens 1024,2048,4096]

Each variant builds its own layer (GEMM choices are cached per layer), captures the forward
into a CUDA graph and times its replays. "current" is the table's choice with its own prefill
fusion records switched off (`GemmChooser.prefill_fused`), timed before and after the variants.
Every timing follows half a second of the same replays (`moehal.bench.settle`), as the benchmark
times its rows. `--json` writes the first tile's results as the tables' `"prefill_fused"`
records (`tools/merge_tuned.py` merges them into the shipped table).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from moehal.kernels.tiles import TileConfig

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): BLOCK_N output columns, so two B tiles
# (gate and up) of BLOCK_N x BLOCK_K per stage
TILES = [  # best first on an H100 (docs/device-runs/2026-11-23-session8/h100/fused-probe.log)
    (128, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4),
    (128, 64, 64, 8, 8, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 5),
    (128, 128, 32, 8, 8, 5),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1024,2048,4096")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--tiles", type=int, default=len(TILES), help="try the first N tiles of TILES")
    p.add_argument("--json", default=None, help="write the first tile's results as prefill_fused records")
    p.add_argument("--source", default="", help="where the log of this run is kept (written into the records)")
    a = p.parse_args()
    del TILES[a.tiles :]
    print(torch.cuda.get_device_name())
    cases = [(s, int(t)) for s in a.shapes.split(",") for t in a.tokens.split(",")]
    records: dict[str, dict] = {}
    for shape, t in cases:
        got = probe_case(shape, t, max(t, a.max_tokens), time.monotonic() + a.budget_s / len(cases))
        torch.cuda.empty_cache()
        if got is not None and a.json:
            key, current, fused = got
            blank = {"config": TileConfig(*TILES[0]).as_dict(), "source": a.source, "layer_us": {}}
            rec = records.setdefault(key, blank)
            rec["layer_us"][str(t)] = {"current": round(current, 1), "fused": round(fused, 1)}
            with open(a.json, "w") as f:  # after every case: a time limit keeps what was measured
                json.dump({"meta": _meta(), "prefill_fused": records}, f, indent=1)


def _meta() -> dict:
    from moehal_cuda.tuning import _meta as tuning_meta

    meta = tuning_meta(torch.cuda.get_device_name())
    meta["method"] = "whole layer, CUDA-graph replays after 0.5 s of replays (tools/fused_prefill_probe.py)"
    return meta


def probe_case(
    shape: str, t: int, max_tokens: int, t_end: float, unfused_baseline: bool = True
) -> tuple[str, float, float] | None:
    """Prints the ranking; returns (GEMM1 key, the faster baseline capture's us, the first tile's
    fused us), or None if the first tile did not run."""
    import moehal
    import moehal_cuda.deepgemm_experts as dx
    from glue_sweep import print_ranked, random_case, timed  # tools/ is this script's directory
    from moehal_cuda.gemm_choice import GemmChoice, GemmChooser, entry_key

    dev = torch.device("cuda")
    choose, table_rule = GemmChooser.choose, GemmChooser.prefill_fused
    cfg, w13, w2, x, ids, wts = random_case(shape, t, max_tokens, dev)
    weights = moehal.quantize_weights(cfg, moehal.QuantScheme.parse("bf16"), w13.to(dev), w2.to(dev))

    def layer_us() -> float:
        if unfused_baseline:  # the baseline without the table's own prefill fusion records
            GemmChooser.prefill_fused = lambda *a, **k: None
        try:  # choices are made at the first forward, inside `timed`
            layer = moehal.MoELayer(cfg, "bf16", device=dev, validate=False)
            layer.load_weights(weights)
            return timed(lambda: layer(x, ids, wts))
        finally:
            GemmChooser.prefill_fused = table_rule

    bases = [layer_us()]
    print(f"== {shape} bf16 T={t}: current {bases[0]:.1f} us")
    rows = []
    for tile in TILES:
        if time.monotonic() > t_end:
            print("  time budget reached")
            break
        tc = TileConfig(*tile)

        def forced(self, e, n, k, dtype, tokens, tc=tc):  # noqa: ANN001, ANN202
            if n == cfg.w13_rows:
                return GemmChoice("triton", tc, tokens, fused_config=tc)
            return choose(self, e, n, k, dtype, tokens)

        GemmChooser.choose = forced
        old = dx.FUSE_MAX_ROWS_PER_EXPERT
        dx.FUSE_MAX_ROWS_PER_EXPERT = 1 << 30
        try:
            rows.append((layer_us(), tile))
        except Exception as exc:  # noqa: BLE001 - a tile that cannot launch here
            print(f"  {tile}: {type(exc).__name__}: {str(exc)[:100]}")
        finally:
            GemmChooser.choose = choose
            dx.FUSE_MAX_ROWS_PER_EXPERT = old
        torch.cuda.empty_cache()
    bases.append(layer_us())
    print_ranked("current", bases, [(us, f"fused GEMM1+act tile {tile}") for us, tile in rows])
    first = [us for us, tile in rows if tile == TILES[0]]
    if not first:
        return None
    # the record keeps the faster baseline capture: fusion must beat the table's choice at its best
    return entry_key(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, "bf16"), min(bases), first[0]


if __name__ == "__main__":
    main()
