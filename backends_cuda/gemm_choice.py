"""Which masked grouped GEMM runs for one GEMM shape and token count: DeepGEMM's, or the Triton
one of `moehal.kernels.triton_grouped_gemm` with a tuned tile. Decided by measurement.

The DeepGEMM experts call a masked grouped GEMM twice per forward (w13, then w2). Measured on
an H100, DeepGEMM's kernel is the faster one for large problems, but not at every shape and
batch: it under-fills the GPU when few experts are active and its short-K tiles (Qwen3's
K = 768) lose to a Triton tile picked for the shape. `python -m moehal_cuda.tuning` measures
both on a device and writes a table next to this module:

    tuned/masked_gemm.<device-slug>.json
    {"meta": {device, torch, triton, deep_gemm, date},
     "entries": {"E=128,N=1536,K=2048,dtype=bf16":
                    {"16": {"use": "triton" | "deepgemm", "config": {BLOCK_M, ...},
                            "us": {"deepgemm": 21.0, "triton": 17.5}}, ...}}}

keyed by token count (the nearest measured count on a log scale is used). No table, no entry
or an entry saying "deepgemm": DeepGEMM runs, as before this module existed. A choice is
looked up once per distinct token count and cached, so the hot path does a dict lookup.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import re
from dataclasses import dataclass
from typing import Any

from moehal.kernels.triton_grouped_gemm import GemmConfig

TUNED_DIR = pathlib.Path(__file__).resolve().parent / "tuned"


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def entry_key(e: int, n: int, k: int, dtype: str) -> str:
    """dtype: 'bf16' or 'fp8_block'."""
    return f"E={e},N={n},K={k},dtype={dtype}"


def table_path(device_name: str, directory: pathlib.Path | None = None) -> pathlib.Path:
    return (directory or TUNED_DIR) / f"masked_gemm.{device_slug(device_name)}.json"


@dataclass(frozen=True)
class GemmChoice:
    use: str  # 'deepgemm' or 'triton'
    config: GemmConfig | None = None
    tuned_tokens: int | None = None  # the measured token count this choice comes from

    @property
    def triton(self) -> bool:
        return self.use == "triton" and self.config is not None


DEEPGEMM = GemmChoice("deepgemm")


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> dict[str, Any]:
    p = pathlib.Path(path)
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{p}: not a masked-GEMM tuning table (no 'entries')")
    return data


def nearest(measured: list[int], tokens: int) -> int:
    """The measured token count closest to `tokens` on a log scale (ties: the smaller)."""
    t = math.log2(max(tokens, 1))
    return min(measured, key=lambda m: (abs(math.log2(max(m, 1)) - t), m))


class GemmChooser:
    """Choices for one device, from its table (if any)."""

    def __init__(self, device_name: str | None, directory: pathlib.Path | None = None) -> None:
        self.path = table_path(device_name, directory) if device_name else None
        self.table = load_table(str(self.path)) if self.path is not None else {}

    @property
    def has_table(self) -> bool:
        return bool(self.table)

    def choose(self, e: int, n: int, k: int, dtype: str, tokens: int) -> GemmChoice:
        entry = self.table.get("entries", {}).get(entry_key(e, n, k, dtype)) if self.table else None
        if not entry:
            return DEEPGEMM
        at = nearest([int(t) for t in entry], tokens)
        row = entry[str(at)]
        if row.get("use") == "triton" and row.get("config"):
            cfg = GemmConfig.from_dict(row["config"])
            if cfg.fits(n, k, dtype == "fp8_block"):
                return GemmChoice("triton", cfg, at)
        return GemmChoice("deepgemm", None, at)
