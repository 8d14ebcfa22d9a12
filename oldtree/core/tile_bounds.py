"""How close a grouped GEMM that computes whole row tiles can get to `moehal bench`'s roofline.

Why this exists: the roofline (`moehal.bench`) counts routed rows only, but a grouped GEMM
computes each expert's rows in tiles of `block_m` rows (DeepGEMM on SM90: 128, or 64 at a
lower rate; Triton kernels: their tile's BLOCK_M). An expert with 257 rows pays for three
128-row tiles. Where experts receive about 256 rows each (DeepSeek-V3's EP8 slice and
Mixtral-8x7B at 1024 tokens, Qwen3-30B-A3B at 4096), half of them need that third tile, and
no kernel of that tile height, however fast, reaches the roofline. This module turns a
routing into that ceiling, so a benchmark row can be read against what is reachable.

Two ceilings per row, both in % of the roofline:
- `tiles_pct`: a kernel at the measured dense matmul rate computing whole tiles (and reading
  each touched expert's weights once at copy bandwidth), with nothing else in the layer.
- `pipeline_pct`: the same GEMMs plus the glue of a pipeline that permutes, activates and
  combines in separate passes, each moving its bytes at copy bandwidth (moehal's CUDA
  pipeline).
- `gathered_pct`: the same without the permute's copy, for a design that gathers each row
  inside its first GEMM (SGLang's and vLLM's Triton fused MoE) and still activates and
  combines in passes of their own.
Both assume bf16 activations and weights (2 bytes) unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moehal.config import MoEConfig


@dataclass(frozen=True)
class TileBound:
    """One row's ceilings; times in microseconds, percentages of the roofline."""

    tokens: int
    block_m: int
    mean_rows: float  # routed rows per local expert
    max_rows: int
    tile_efficiency: float  # routed rows / rows computed in whole tiles
    roofline_us: float
    gemm_floor_us: float
    glue_floor_us: float
    tiles_pct: float
    pipeline_pct: float
    gathered_pct: float

    def gemm_rate_needed(self, pct: float) -> float:
        """The fraction of the measured ceilings the two GEMMs must run at, on whole tiles,
        for the layer with its glue floor to reach `pct` % of the roofline (`inf` where the
        glue alone takes longer than that budget). Above 1.0 no kernel of this tile height
        gets there with this pipeline."""
        return self.gemm_rate_at(self.roofline_us / (pct / 100))

    def gemm_rate_at(self, layer_us: float) -> float:
        """The fraction of the measured ceilings the GEMMs ran at in a layer that took
        `layer_us`, if its glue ran at the floor. Glue slower than the floor leaves the GEMMs
        less time, so their true rate is at least this. (The ceilings are torch's dense
        matmul and copy in the same run, not the hardware's peak: a grouped GEMM can beat them
        by a few percent.)"""
        budget = layer_us - self.glue_floor_us
        return self.gemm_floor_us / budget if budget > 0 else float("inf")


def padded_rows(counts: torch.Tensor, block_m: int) -> int:
    """Rows a grouped GEMM computes when each expert's `counts[e]` rows fill whole `block_m`
    tiles (an expert with no rows computes none)."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    return int(((counts.long() + block_m - 1) // block_m * block_m).sum())


def glue_bytes(cfg: MoEConfig, tokens: int, elem_bytes: int = 2, permute: bool = True) -> int:
    """Bytes the glue passes of an unfused pipeline read and write at least:
    permute (read each token once, write its top-k rows; left out with `permute=False`),
    activation (read the GEMM1 output rows, write half as many for gated activations) and
    combine (read the GEMM2 rows, write one row per token). Routing ids and weights are left
    out: they are small beside these."""
    routed = tokens * cfg.top_k
    h, i = cfg.hidden_size, cfg.intermediate_size
    copy = tokens * h + routed * h if permute else 0
    activation = routed * cfg.w13_rows + routed * i
    combine = routed * h + tokens * h
    return (copy + activation + combine) * elem_bytes


def tile_bound(
    cfg: MoEConfig,
    counts: torch.Tensor,
    copy_bytes_per_s: float,
    matmul_flops_per_s: float,
    block_m: int = 128,
    elem_bytes: int = 2,
) -> TileBound:
    """Ceilings for one routing: `counts[e]` rows routed to local expert `e`; the ceilings are
    `moehal.bench`'s (copy bandwidth in bytes read + written per second, dense matmul FLOP/s).
    The roofline is the benchmark's: max(touched experts' weight bytes / bandwidth, routed
    FLOPs / matmul rate)."""
    counts = counts.flatten().long()
    routed = int(counts.sum())
    if routed == 0:
        raise ValueError("no routed rows")
    tokens = routed // cfg.top_k
    h, i = cfg.hidden_size, cfg.intermediate_size
    flops_per_row = 2 * (h * cfg.w13_rows + i * h)
    weight_bytes = int((counts > 0).sum()) * (cfg.w13_rows * h + h * i) * elem_bytes
    roof = max(weight_bytes / copy_bytes_per_s, routed * flops_per_row / matmul_flops_per_s)
    padded = padded_rows(counts, block_m)
    gemm = max(weight_bytes / copy_bytes_per_s, padded * flops_per_row / matmul_flops_per_s)
    glue = glue_bytes(cfg, tokens, elem_bytes) / copy_bytes_per_s
    gathered = glue_bytes(cfg, tokens, elem_bytes, permute=False) / copy_bytes_per_s
    return TileBound(
        tokens=tokens,
        block_m=block_m,
        mean_rows=routed / counts.numel(),
        max_rows=int(counts.max()),
        tile_efficiency=routed / padded,
        roofline_us=roof * 1e6,
        gemm_floor_us=gemm * 1e6,
        glue_floor_us=glue * 1e6,
        tiles_pct=100 * roof / gemm,
        pipeline_pct=100 * roof / (gemm + glue),
        gathered_pct=100 * roof / (gemm + gathered),
    )
