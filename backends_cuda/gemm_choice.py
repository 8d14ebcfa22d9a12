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

keyed by token count (the nearest measured count on a log scale is used). bf16 GEMM1 rows
where the experts fuse GEMM1 with the activation may also hold that fused kernel's own tile,
`"fused": {"config", "us", "adapted_us"}` (`python -m moehal_cuda.tuning --fused-only`).

`"decode_fused"` holds whole-layer measurements of FP8 decode batches with GEMM1 fused with the
activation and GEMM2's input quantization, per fp8 GEMM1 shape and token count, with the fused
tile where it is not the plain GEMM1 tile adapted (`tools/decode_fused_records.py`, from
`tools/bench_ab.py` logs):

    "decode_fused": {"E=128,N=1536,K=2048,dtype=fp8_block":
                        {"source": "...", "layer_us": {"1": {"current": 24.6, "fused": 22.8,
                                                             "config": {BLOCK_M, ...}}, ...}}}

Beside the entries, `"prefill_fused"` holds whole-layer measurements of prefill batches with
GEMM1 run as the fused GEMM1 + activation kernel in place of the chosen GEMM1 followed by the
activation kernel, per bf16 GEMM1 shape (`tools/fused_prefill_probe.py`; the entries compare
plain GEMM1s, so they never weigh the activation kernel that fusion removes):

    "prefill_fused": {"E=128,N=1536,K=2048,dtype=bf16":
                         {"config": {BLOCK_M, ...}, "source": "...",
                          "layer_us": {"2048": {"current": 646.0, "fused": 607.8}, ...}}}

`"prefill_portable"` holds whole-layer measurements of batches run as the portable
Triton fused MoE of `moehal.kernels.triton_fused_moe` (token-major input: it gathers rows inside
its GEMM1, fuses the activation, and tiles experts' rows 64 high where DeepGEMM's contiguous
and masked layouts pad them to 128), against the pipeline otherwise chosen, per layer shape
(`tools/portable_prefill_probe.py`; keyed by scheme too: fp8_block and fp8_tensor layers run
it only where their own scheme was measured, fp8_tensor from one token up):

    "prefill_portable": {"E=128,H=2048,I=768,top_k=8,gated=1,dtype=bf16":
                            {"source": "...", "layer_us": {"1024": {"current": 530.6,
                                                                    "portable": 486.4}, ...}}}

No table, no entry,
an entry saying "deepgemm", or a Triton win under `MIN_GAIN`: DeepGEMM runs, as before this
module existed. A choice is
looked up once per distinct token count and cached, so the hot path does a dict lookup.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

from moehal.hardware import device_slug
from moehal.kernels.tiles import FP8_GROUP, TileConfig  # pure Python: declaring the CUDA plugin imports no triton

TUNED_DIR = pathlib.Path(__file__).resolve().parent / "tuned"
# Triton replaces DeepGEMM only when it measured at least this much faster: two H100 runs of
# one build differ by a few percent, and a choice inside that noise is no choice (it flipped
# Mixtral's w13 GEMM at 4096 tokens on a 1% margin, and the layer then measured 4% slower).
MIN_GAIN = 0.03
# The whole-layer records of the portable fused MoE are timed with both variants in turns, in
# one process, best of rounds (`tools/portable_prefill_probe.py`): on an H100 their rounds
# spread by up to 1.6%, and a 3% margin turned a win measured at 3.9%, 3.0% and (paired
# weights, in the benchmark) 5.4% into "no" on one 2.97% reading (session 13). So 1%.
PORTABLE_MIN_GAIN = 0.01


def entry_key(e: int, n: int, k: int, dtype: str) -> str:
    """dtype: 'bf16' or 'fp8_block'."""
    return f"E={e},N={n},K={k},dtype={dtype}"


def layer_key(e: int, h: int, i: int, top_k: int, gated: bool, dtype: str = "bf16") -> str:
    """A whole-layer record's key: experts, hidden and intermediate size, top-k, gating, and the
    weights' scheme ('bf16', 'fp8_block' or 'fp8_tensor')."""
    return f"E={e},H={h},I={i},top_k={top_k},gated={int(gated)},dtype={dtype}"


def table_path(device_name: str, directory: pathlib.Path | None = None) -> pathlib.Path:
    """The device's table: in `directory` if given, else the one `register_table` named for the
    device, else the one shipped in the package."""
    name = f"masked_gemm.{device_slug(device_name)}.json"
    if directory is not None:
        return directory / name
    return _REGISTERED.get(device_slug(device_name), TUNED_DIR / name)


_REGISTERED: dict[str, pathlib.Path] = {}


def register_table(device_name: str, path: str | pathlib.Path) -> None:
    """Use the table at `path` for GPUs named `device_name` (layers built from now on), in place
    of the shipped one: a table tuned where moehal is installed from a wheel
    (`python -m moehal_cuda.tuning --out my_table.json`), kept outside site-packages. The file
    is read when the first layer is built, and must exist then."""
    p = pathlib.Path(path).expanduser().resolve()
    if not p.is_file():
        raise FileNotFoundError(f"no masked-GEMM table at {p}")
    load_table(str(p))  # a malformed file is refused now, not at the first build
    _REGISTERED[device_slug(device_name)] = p


@dataclass(frozen=True)
class GemmChoice:
    use: str  # 'deepgemm' or 'triton'
    config: TileConfig | None = None
    tuned_tokens: int | None = None  # the measured token count this choice comes from
    # GEMM1 fused with the activation: its own measured tile (None: adapt `config` to it)
    fused_config: TileConfig | None = None

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
        us = row.get("us", {})
        faster = "triton" in us and "deepgemm" in us and us["triton"] <= (1.0 - MIN_GAIN) * us["deepgemm"]
        if row.get("use") == "triton" and row.get("config") and faster:
            cfg = TileConfig.from_dict(row["config"])
            if cfg.fits(n, k, dtype == "fp8_block"):
                return GemmChoice("triton", cfg, at, _fused_tile(row.get("fused"), n, k))
        return GemmChoice("deepgemm", None, at)

    def triton_tile(self, e: int, n: int, k: int, dtype: str, tokens: int) -> TileConfig | None:
        """The fastest Triton tile the table measured for this GEMM shape at the nearest measured
        count (log scale), whichever kernel won there: for experts that always run the Triton
        GEMM (`moehal_cuda.nvfp4_dequant` takes the bf16 rows, its operands being bf16). None
        without a table, an entry or a tile that fits."""
        entry = self.table.get("entries", {}).get(entry_key(e, n, k, dtype)) if self.table else None
        if not entry:
            return None
        row = entry[str(nearest([int(t) for t in entry], tokens))]
        if not row.get("config"):
            return None
        cfg = TileConfig.from_dict(row["config"])
        return cfg if cfg.fits(n, k, dtype == "fp8_block") else None

    def prefill_fused(self, e: int, n13: int, k: int, tokens: int) -> TileConfig | None:
        """The fused GEMM1 + activation tile for a bf16 batch of `tokens` with GEMM1 shape
        (e, n13, k), where the table's whole-layer measurement at the nearest measured count
        (log scale) has the fused layer at least `MIN_GAIN` faster. None without a table or a
        record for the shape, below its smallest measured count, or where the tile does not fit."""
        rec = self.table.get("prefill_fused", {}).get(entry_key(e, n13, k, "bf16")) if self.table else None
        if not rec or not rec.get("layer_us"):
            return None
        measured = [int(t) for t in rec["layer_us"]]
        if tokens < min(measured):
            return None
        us = rec["layer_us"][str(nearest(measured, tokens))]
        if us["fused"] > (1.0 - MIN_GAIN) * us["current"]:
            return None
        cfg = TileConfig.from_dict(rec["config"])
        return cfg if cfg.fits(n13 // 2, k, False) else None

    def decode_fused(self, e: int, n13: int, k: int, dtype: str, tokens: int) -> tuple[bool, TileConfig | None]:
        """Whether an FP8 decode batch of `tokens` with GEMM1 shape (e, n13, k) fuses GEMM1 with
        the activation and GEMM2's input quantization, and on which tile: (True, tile), or
        (True, None) for the plain GEMM1 tile adapted to the fused kernel, where the table's
        whole-layer measurement at the nearest measured count (log scale) has the fused layer at
        least `MIN_GAIN` faster; (False, None) without a table, a record or such a win."""
        rec = self.table.get("decode_fused", {}).get(entry_key(e, n13, k, dtype)) if self.table else None
        if not rec or not rec.get("layer_us"):
            return False, None
        us = rec["layer_us"][str(nearest([int(t) for t in rec["layer_us"]], tokens))]
        if us["fused"] > (1.0 - MIN_GAIN) * us["current"]:
            return False, None
        if not us.get("config"):
            return True, None
        cfg = TileConfig.from_dict(us["config"])
        whole = cfg.block_n % FP8_GROUP == 0 or FP8_GROUP % cfg.block_n == 0  # groups, or a fraction of one
        return (True, cfg) if whole and cfg.fits(n13 // 2, k, True) else (False, None)

    def portable_prefill_range(
        self, e: int, h: int, i: int, top_k: int, gated: bool, dtype: str = "bf16"
    ) -> tuple[int, int | None] | None:
        """The token counts (lo, hi; hi None: no bound) at which batches of this layer shape and
        weight scheme (`dtype`: 'bf16', 'fp8_block' or 'fp8_tensor') run the portable Triton fused MoE: the
        longest run of consecutive measured counts where the table's whole-layer measurements
        have it at least `PORTABLE_MIN_GAIN` faster than the pipeline otherwise chosen (among runs
        of one length, the one that saves the larger share of time summed over its counts; then
        the larger counts). A bound next to a measured count that lost lies halfway between the two
        on a log scale (each batch goes the way its nearest measured count went); the run's
        smallest count is its lower bound where nothing smaller was measured, and a run up to
        the largest measured count has no upper bound. None without a record or a win."""
        key = layer_key(e, h, i, top_k, gated, dtype)
        rec = self.table.get("prefill_portable", {}).get(key) if self.table else None
        if not rec or not rec.get("layer_us"):
            return None
        counts = sorted(int(t) for t in rec["layer_us"])
        saved, wins = [], []  # per count: the share of the pipeline's time saved; whether it won
        for t in counts:
            us = rec["layer_us"][str(t)]
            saved.append(1.0 - us["portable"] / us["current"])
            wins.append(us["portable"] <= (1.0 - PORTABLE_MIN_GAIN) * us["current"])
        runs = []  # (length, summed share saved, first index, last index) of each run of wins
        j = 0
        while j < len(counts):
            if not wins[j]:
                j += 1
                continue
            k = j
            while k + 1 < len(counts) and wins[k + 1]:
                k += 1
            runs.append((k - j + 1, sum(saved[j : k + 1]), j, k))
            j = k + 1
        if not runs:
            return None
        _, _, first, last = max(runs)
        lo = counts[first] if first == 0 else math.isqrt(counts[first - 1] * counts[first]) + 1
        hi = None if last == len(counts) - 1 else math.isqrt(counts[last] * counts[last + 1])
        return lo, hi


def band_edge_notes(layer_us: dict[str, dict[str, float]], band: tuple[int, int | None]) -> list[str]:
    """Where a band's bound is a guess: each edge of `band` (from `portable_prefill_range`) whose
    neighbouring measured counts, inside and outside, lie more than 2x apart. Every batch size
    between them goes the way of the nearer one, measured or not (session 23: a 5-512 band from
    a 1% win at 256 and a loss at 1024 sent 512 tokens to a kernel 1.26x slower)."""
    counts = sorted(int(t) for t in layer_us)
    lo, hi = band
    inside = [t for t in counts if lo <= t <= (hi if hi is not None else t)]
    notes = []
    for edge, near, far in (
        (lo, inside[0], max((t for t in counts if t < lo), default=None)),
        (hi, inside[-1], min((t for t in counts if hi is not None and t > hi), default=None)),
    ):
        if edge is None or far is None or max(near, far) <= 2 * min(near, far):
            continue
        us = layer_us[str(near)]
        saved = 1.0 - us["portable"] / us["current"]
        notes.append(
            f"the bound {edge} lies between {near} tokens (the portable kernel saved {saved:.1%}) and {far}"
            f" (no win), {max(near, far) // min(near, far)}x apart: counts between them are unmeasured"
        )
    return notes


def _fused_tile(fused: dict[str, Any] | None, n: int, k: int) -> TileConfig | None:
    """The fused GEMM1 + activation tile of a row (`moehal_cuda.tuning.tune_fused`), where it
    measured at least `MIN_GAIN` faster than the plain GEMM1 tile adapted to the fused kernel."""
    if not fused or "config" not in fused or fused.get("us", 0.0) > (1.0 - MIN_GAIN) * fused.get("adapted_us", 0.0):
        return None
    cfg = TileConfig.from_dict(fused["config"])
    return cfg if cfg.fits(n // 2, k, False) else None


def main(argv: list[str] | None = None) -> int:
    """`python -m moehal_cuda.gemm_choice [DEVICE NAME]`: the effective choices of a table."""
    import argparse

    from moehal.cli.common import make_console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="python -m moehal_cuda.gemm_choice", description=main.__doc__)
    ap.add_argument("device", nargs="?", help="device name (default: this machine's CUDA device)")
    args = ap.parse_args(argv)
    name = args.device
    if name is None:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: name one, e.g. 'NVIDIA H100 80GB HBM3'")
            return 2
        name = torch.cuda.get_device_name()
    chooser = GemmChooser(name)
    if not chooser.has_table:
        print(f"no tuned table for {name!r} ({chooser.path}): DeepGEMM runs every masked GEMM")
        return 0
    meta = chooser.table.get("meta", {})
    t = Table(title=f"masked GEMM choices: {meta.get('device', name)} ({meta.get('date', '?')})")
    for col in ("GEMM", "tokens", "DeepGEMM us", "Triton us", "runs"):
        t.add_column(col, justify="right" if col != "GEMM" else "left")
    for key, entry in chooser.table["entries"].items():
        e, n, k, dtype = (p.split("=")[1] for p in key.split(","))
        for tokens, row in entry.items():
            ch = chooser.choose(int(e), int(n), int(k), dtype, int(tokens))
            us = {name: f"{row.get('us', {}).get(name, float('nan')):.1f}" for name in ("deepgemm", "triton")}
            t.add_row(key, tokens, us["deepgemm"], us["triton"], ch.use)
    make_console().print(t)
    pre = chooser.table.get("prefill_fused", {})
    if pre:
        t = Table(title="bf16 prefill: GEMM1 fused with the activation (whole layer)")
        for col in ("GEMM1", "tokens", "current us", "fused us", "fused"):
            t.add_column(col, justify="right" if col != "GEMM1" else "left")
        for key, rec in pre.items():
            e, n, k, _ = (p.split("=")[1] for p in key.split(","))
            for tokens, us in rec.get("layer_us", {}).items():
                tile = chooser.prefill_fused(int(e), int(n), int(k), int(tokens))
                t.add_row(key, tokens, f"{us['current']:.1f}", f"{us['fused']:.1f}", "yes" if tile else "no")
        make_console().print(t)
    dec = chooser.table.get("decode_fused", {})
    if dec:
        t = Table(title="fp8 decode: GEMM1 fused with the activation and GEMM2's quantization (whole layer)")
        for col in ("GEMM1", "tokens", "current us", "fused us", "gain", "fused", "tile"):
            t.add_column(col, justify="right" if col != "GEMM1" else "left")
        for key, rec in dec.items():
            e, n, k, dtype = (p.split("=")[1] for p in key.split(","))
            for tokens, us in rec.get("layer_us", {}).items():
                fuse, tile = chooser.decode_fused(int(e), int(n), int(k), dtype, int(tokens))
                shown = "adapted" if tile is None else f"{tile.block_m}x{tile.block_n}x{tile.block_k}"
                cur, fus = us["current"], us["fused"]
                row = (f"{cur:.1f}", f"{fus:.1f}", f"{cur / fus:.3f}x", "yes" if fuse else "no", shown if fuse else "")
                t.add_row(key, tokens, *row)
        make_console().print(t)
    port = chooser.table.get("prefill_portable", {})
    if port:
        t = Table(title="prefill: the portable Triton fused MoE in place of the pipeline (whole layer)")
        for col in ("layer", "tokens", "current us", "portable us", "gain", "portable", "band"):
            t.add_column(col, justify="right" if col != "layer" else "left")
        notes: list[str] = []
        for key, rec in port.items():
            f = dict(p.split("=") for p in key.split(","))
            dims = (int(f["E"]), int(f["H"]), int(f["I"]), int(f["top_k"]))
            band = chooser.portable_prefill_range(*dims, f["gated"] == "1", f.get("dtype", "bf16"))
            # the band once per layer: what the halfway bounds and the tie-break made of the counts
            shown = "none" if band is None else f"{band[0]}-{band[1]}" if band[1] else f"{band[0]}+"
            for tokens, us in rec.get("layer_us", {}).items():
                inside = band is not None and band[0] <= int(tokens) <= (band[1] or int(tokens))
                runs = "yes" if inside else "no"
                gain = f"{us['current'] / us['portable']:.3f}x"
                t.add_row(key, tokens, f"{us['current']:.1f}", f"{us['portable']:.1f}", gain, runs, shown)
                shown = ""
            notes += [f"{key}: {note}" for note in band_edge_notes(rec.get("layer_us", {}), band)] if band else []
        make_console().print(t)
        for note in notes:  # where a measurement between two counts would move a bound
            print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
