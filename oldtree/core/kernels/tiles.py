"""`TileConfig`: one Triton GEMM tile (block sizes, grouping, warps, pipeline stages), shared by
the fused-MoE kernels (`triton_fused_moe`) and the masked grouped GEMM (`triton_grouped_gemm`).
Pure Python (no triton import): the tuned tables are read where Triton is absent too.

Two JSON spellings are read: this project's tables (`BLOCK_M`, `GROUP_M`, ...; written by
`as_dict`) and vLLM / SGLang fused-MoE configs (`BLOCK_SIZE_M`, `GROUP_SIZE_M`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from moehal.kernels.host import next_power_of_2

FP8_GROUP = 128  # FP8 block-scale group along K


def nearest_count(table: dict[str, object], tokens: int) -> str:
    """The key of a table keyed by token count (other keys, such as `_meta`, are skipped)
    nearest to `tokens`: how vLLM and SGLang pick a fused-MoE config, and so do we."""
    counts = [k for k in table if k.isdigit()]
    if not counts:
        raise ValueError("no token-count keys")
    return min(counts, key=lambda k: abs(int(k) - tokens))


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Weight tiles by TMA (Hopper's tensor memory accelerator): read by the fused-MoE kernel
    # only, where the GPU and the weights allow it (`triton_fused_moe.tma_weights_ok`).
    tma: bool = False

    def as_dict(self) -> dict[str, int]:
        d = {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }
        if self.tma:
            d["USE_TMA"] = 1  # SGLang's spelling: written only when set, so older tables read the same
        return d

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> TileConfig:
        """From either spelling; vLLM-style configs default to 2 stages (as vLLM does). SGLang's
        `USE_TMA` (weight tiles by TMA) is read in both."""
        vllm = "BLOCK_SIZE_M" in d
        key = (lambda s: f"BLOCK_SIZE_{s}") if vllm else (lambda s: f"BLOCK_{s}")
        return cls(
            int(d[key("M")]),
            int(d[key("N")]),
            int(d[key("K")]),
            int(d.get("GROUP_SIZE_M" if vllm else "GROUP_M", 1)),
            int(d.get("num_warps", 4)),
            int(d.get("num_stages", 2 if vllm else 3)),
            bool(d.get("USE_TMA", False)),
        )

    def fits(self, n: int, k: int, fp8: bool) -> bool:
        """Whether the masked grouped GEMM can run this tile on an (N, K) problem: K tiles must
        divide K (its K loop has no tail), and an FP8 K tile must not straddle two scale groups."""
        if k % self.block_k or (fp8 and FP8_GROUP % self.block_k):
            return False
        return self.block_n <= max(16, next_power_of_2(n))
