# Triton reads annotations of @triton.jit parameters (tl.constexpr, type strings), so the
# kernels' untyped parameters stay untyped on purpose:
# ruff: noqa: ANN001, ANN202
"""Portable Triton fused MoE: one implementation for the ROCm and CUDA backends.

The algorithm is the one vLLM and SGLang use (written afresh here):

1. `moe_align_block_size`: the T*K (token, k) slots are bucketed by local expert and each
   bucket is padded to a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted slot
   list belongs to one expert. Sizes are static worst cases (no host sync): the sorted list
   has `T*K + E*(BLOCK_M-1)` entries, the live prefix is `num_tokens_post_padded`.
   Slots of experts that are not local (id -1 in the STANDARD layout) are left out.
2. `_fused_moe_kernel` (GEMM1): a grouped GEMM over the sorted tiles, A row = slot // top_k,
   B = w13[expert]. The gate and up halves are computed in the same program and the activation
   (silu/gelu gated or not, swiglu_oai) is fused into the epilogue, so the `[T*K, 2I]`
   intermediate never exists. On paired weights (`pair_gate_up`, unquantized) that is one
   `[BM, 2*BN]` dot per K step, split in the epilogue; otherwise two accumulators.
3. Activation quantization for GEMM2 (fp8 1x128 groups or int8 per row), in Triton.
4. `_fused_moe_kernel` (GEMM2): same kernel, A row = slot, times the router weight
   (MUL_ROUTED_WEIGHT) and plus the w2 bias.
5. `_moe_sum_kernel`: sum over k of the weighted rows, skipping slots of non-local experts.

Weight tiles can be read by TMA (a tile's `tma`, SGLang's `USE_TMA`) on SM90 and newer, through
a host-side tensor descriptor of the `[E, N, K]` weights; elsewhere the same tile uses pointer
loads. Only a tuned table turns it on (the heuristic never does).

Quantization: bf16/fp16/fp32 (fp32 accumulate); fp8 block scale (weights 128x128 blocks,
activations 1x128 groups, quantized here); fp8 per-tensor (one weight scale per expert, static
activation scales from the checkpoint: GEMM1's epilogue writes its output already quantized
for GEMM2, so that scheme has no quantization pass between the GEMMs); int8 W8A8 (per-channel
weight scale, dynamic per-token activation scale, int32 accumulate).

FP8 flavour: e4m3fn (OCP) on NVIDIA and gfx950/gfx12; e4m3fnuz on MI300 (gfx942). The bits of
an e4m3fnuz number are worth half those of e4m3fn (exponent bias 8 instead of 7), so canonical
e4m3fn weights become e4m3fnuz by keeping the bits and doubling the scale;
the one e4m3fn pattern that means NaN in fnuz, 0x80 (-0.0), becomes +0 (the ROCm backend's
weight processor does this, `moehal.kernels.triton_experts.to_fnuz`). Activations are
quantized to fnuz with a maximum of 224 (= 448 / 2), which gives exactly the values the
e4m3fn reference quantizer gives.

Importing the `moehal.kernels` package never imports Triton: this module and the other kernel
modules do, and plugins import them lazily (in `build` / `load`).

Interpreter (TRITON_INTERPRET=1, CPU tensors): `tl.dot` on BF16 operands returns garbage in
the interpreter (numpy has no bfloat16 matmul), so under the interpreter the kernel gets
`UPCAST=True` and converts both dot operands to fp32 first. Compiled kernels never upcast.
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from moehal.hardware import device_slug
from moehal.kernels.host import cdiv, interpreting, kernel_modules_interpreted, next_power_of_2
from moehal.kernels.launch import Site, fast_launch, site
from moehal.kernels.tiles import TileConfig, nearest_count

INTERPRETED = kernel_modules_interpreted()  # as triton.jit decorates this module's kernels (host.py)

# ----------------------------------------------------------------------------------------------
# Environment and capabilities
# ----------------------------------------------------------------------------------------------

FP8_E4M3FN_MAX = 448.0
# Quantizing to e4m3fnuz with 224 = 448/2 reproduces the e4m3fn grid exactly (see module doc).
FP8_E4M3FNUZ_QMAX = 224.0
INT8_MAX = 127.0
GROUP = 128  # fp8 block size: weights 128x128, activations 1x128


def fp8_qmax(fp8_dtype: torch.dtype) -> float:
    return FP8_E4M3FNUZ_QMAX if fp8_dtype == torch.float8_e4m3fnuz else FP8_E4M3FN_MAX


# ----------------------------------------------------------------------------------------------
# Block-size configs: heuristic + tuned tables
# ----------------------------------------------------------------------------------------------


# --- TUNED TABLES HOOK ------------------------------------------------------------------------
# Per-GPU tuned configs live next to this module as JSON files named
#     triton_fused_moe.<device-slug>.json      (slug: device name, lower case, [a-z0-9] and '_')
# e.g. `triton_fused_moe.amd_instinct_mi300x.json`, `triton_fused_moe.nvidia_h100_80gb_hbm3.json`:
#     {"<key>": {"<M>": {"gemm1": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M,
#                                  num_warps, num_stages},
#                        "gemm2": {...}}}}     ("gemm2" may be left out: gemm1's is used)
# with <key> = "E=<local experts>,H=<hidden>,I=<intermediate>,dtype=<bf16|fp16|fp32|fp8_block|int8>"
# and <M> the token count the entry was tuned for (the nearest one is used). BLOCK_SIZE_M must
# be the same for both GEMMs (they share one alignment). Entries registered at run time with
# `register_tuned_configs` take precedence over files.
_TUNED_DIR = pathlib.Path(__file__).resolve().parent
_RUNTIME_TABLES: dict[str, dict[str, dict[str, Any]]] = {}
# Bumped by `register_tuned_configs`: whoever keeps bound launches (`bind_fused_moe`) rebinds.
TABLES_VERSION = 0


def table_key(e: int, h: int, i: int, dtype: str) -> str:
    return f"E={e},H={h},I={i},dtype={dtype}"


def register_tuned_configs(device_name: str, table: dict[str, dict[str, Any]]) -> None:
    """Add tuned entries for a device at run time (same format as the JSON files)."""
    global TABLES_VERSION
    _RUNTIME_TABLES.setdefault(device_slug(device_name), {}).update(table)
    _file_table.cache_clear()
    TABLES_VERSION += 1


@functools.lru_cache(maxsize=32)
def _file_table(slug: str) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    path = _TUNED_DIR / f"triton_fused_moe.{slug}.json"
    if path.is_file():
        table.update(json.loads(path.read_text()))
    table.update(_RUNTIME_TABLES.get(slug, {}))
    return table


def has_tuned_entry(device_name: str, key: str) -> bool:
    """Whether `device_name` has a tuned entry under `key` (`table_key`), from a file or
    registered at run time."""
    return bool(_file_table(device_slug(device_name)).get(key))


def _fit(cfg: TileConfig, n: int, k: int, quant: str) -> TileConfig:
    """Clamp block sizes to the problem and to the kernel's constraints."""
    bn = max(16, min(cfg.block_n, next_power_of_2(n)))
    bk = max(16, min(cfg.block_k, next_power_of_2(k)))
    if quant == "fp8_block":
        bk = min(bk, GROUP)  # a K tile must not straddle two 128-wide scale groups
    if quant in ("fp8_block", "fp8_tensor", "int8"):
        # fp8 and int8 dots take K tiles of 32 or more (Hopper's wgmma; CDNA's int8 MFMA: a K
        # tile of 16 compiled to no matrix instruction at all for gfx942 and gfx950, session 54)
        bk = max(bk, 32)
    return replace(cfg, block_n=bn, block_k=bk)


def heuristic_configs(
    m: int, e: int, h: int, i: int, top_k: int, quant: str, is_rocm: bool
) -> tuple[TileConfig, TileConfig]:
    """Block sizes for (GEMM1, GEMM2) by the expected rows per expert.

    Small batches (decode) get short M tiles so few rows are padding; large ones get
    128-row tiles and grouped ordering for L2 reuse. GEMM1 holds two accumulators (gate and
    up), so its N tile is half GEMM2's at the largest size. AMD's stream pipeliner prefers
    num_stages=2; NVIDIA's prefers 3-4.
    """
    rows = max(1, m * top_k // max(e, 1))
    if interpreting():
        # The interpreter's cost is per program and per op, not per element: few, wide tiles.
        bm = 16 if rows <= 16 else 32
        return TileConfig(bm, 256, 256, 1, 4, 1), TileConfig(bm, 256, 256, 1, 4, 1)
    stages = 2 if is_rocm else 3
    bk = 128 if quant in ("fp8_block", "fp8_tensor", "int8") else 64
    if rows <= 16:
        g1 = TileConfig(16, 64, bk, 1, 4, stages)
        g2 = TileConfig(16, 64, bk, 1, 4, stages)
    elif rows <= 64:
        g1 = TileConfig(32, 64, bk, 8, 4, stages)
        g2 = TileConfig(32, 128, bk, 8, 4, stages)
    elif rows <= 256:
        g1 = TileConfig(64, 64, bk, 8, 4, stages)
        g2 = TileConfig(64, 128, bk, 8, 8, stages)
    else:
        g1 = TileConfig(128, 64, bk, 8, 8, stages)
        g2 = TileConfig(128, 128, bk, 8, 8, stages)
    return g1, g2


def select_configs(
    m: int,
    e: int,
    h: int,
    i: int,
    top_k: int,
    quant: str,
    dtype_name: str,
    device_name: str | None = None,
    is_rocm: bool = False,
) -> tuple[TileConfig, TileConfig]:
    """(GEMM1, GEMM2) configs: a tuned table entry for this device if one exists, else the
    heuristic. quant: 'none' | 'fp8_block' | 'fp8_tensor' | 'int8'."""
    key_dtype = dtype_name if quant == "none" else quant
    g1 = g2 = None
    if device_name:
        entry = _file_table(device_slug(device_name)).get(table_key(e, h, i, key_dtype))
        if entry:
            best = nearest_count(entry, m)
            g1 = TileConfig.from_dict(entry[best]["gemm1"])
            g2 = TileConfig.from_dict(entry[best].get("gemm2", entry[best]["gemm1"]))
    if g1 is None or g2 is None:
        g1, g2 = heuristic_configs(m, e, h, i, top_k, quant, is_rocm)
    if g2.block_m != g1.block_m:
        g2 = replace(g2, block_m=g1.block_m)
    return _fit(g1, i, h, quant), _fit(g2, h, i, quant)


# ----------------------------------------------------------------------------------------------
# moe_align_block_size (Triton, sync-free; its torch-op reference below)
# ----------------------------------------------------------------------------------------------


def align_sizes(num_slots: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """Static (sorted length, number of M blocks)."""
    length = num_slots + num_experts * (block_m - 1)
    return length, cdiv(length, block_m) if length else 0


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*K slots by local expert, each expert's run padded to a multiple of block_m.

    topk_ids `[T, K]` local expert ids; -1 (or any id outside [0, E)) = not on this rank.
    Returns
      sorted_ids int32 `[T*K + E*(block_m-1)]`: slot index (token*K + k), pad value T*K;
      expert_ids int32 `[ceil(len/block_m)]`: the expert of each M block, -1 past the end;
      num_tokens_post_padded int32 `[1]`: length of the live prefix (a multiple of block_m).
    Slots of non-local experts appear nowhere. No host synchronization; stable in slot order.

    Two or three launches: the permute's per-expert positions (`expert_positions`), then one
    kernel that places each slot, fills the padding and labels the blocks. Equal, element for
    element, to `moe_align_block_size_torch` (about twenty small torch ops).
    """
    s, e = topk_ids.numel(), num_experts
    if s == 0 or e == 0:
        return moe_align_block_size_torch(topk_ids, block_m, num_experts)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    return bind_align(s, e, block_m)(ids)


def _round16(n: int) -> int:
    """n int32 elements rounded up to a whole number of 16 bytes."""
    return (n + 3) // 4 * 4


def bind_align(num_slots: int, num_experts: int, block_m: int) -> AlignLaunch:
    """`moe_align_block_size`'s launches for `num_slots` > 0 slots and `num_experts` > 0
    experts: sizes, grid and constants decided once (a bound forward keeps one)."""
    from moehal.kernels.triton_permute import bind_positions  # (it imports this module)

    s, e = num_slots, num_experts
    length, nblocks = align_sizes(s, e, block_m)
    e_p = next_power_of_2(e)
    block = max(16, min(1024, 4096 // e_p))  # a [block, E] comparison per program
    slot_programs = cdiv(s, block)
    at_experts = _round16(length)
    offsets = (at_experts, at_experts + _round16(nblocks))
    return AlignLaunch(
        bind_positions(s, e), length, nblocks, offsets, (slot_programs + cdiv(length, block),),
        (s, length, e, slot_programs), dict(BLOCK_M=block_m, E_P=e_p, BLOCK=block),
    )  # fmt: skip


@dataclass(frozen=True)
class AlignLaunch:
    """`moe_align_block_size` for one slot count, expert count and block height (`bind_align`)."""

    positions: Any  # `triton_permute.BoundPositions` for these slots and experts
    length: int
    nblocks: int
    offsets: tuple[int, int]  # where expert_ids and num_post start in the one allocation
    grid: tuple[int]
    scalars: tuple[int, int, int, int]  # slots, sorted length, experts, slot programs
    kw: dict[str, int]

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids: the flat, contiguous `[S]` local expert ids -> (sorted_ids, expert_ids,
        num_tokens_post_padded), as `moe_align_block_size` returns them: three views of one
        allocation, each starting on a 16-byte boundary."""
        slot_pos, counts = self.positions(ids)
        at_experts, at_post = self.offsets
        meta = torch.empty(at_post + 1, dtype=torch.int32, device=ids.device)
        sorted_ids, expert_ids = meta[: self.length], meta[at_experts : at_experts + self.nblocks]
        num_post = meta[at_post:]
        self._site(ids, slot_pos, counts, sorted_ids, expert_ids, num_post, *self.scalars)
        return sorted_ids, expert_ids, num_post

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_align_finish, self.grid, **self.kw)


@fast_launch
@triton.jit
def _align_finish(
    ids_ptr, slot_pos_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, S, L, E, slot_programs,
    BLOCK_M: tl.constexpr, E_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Programs [0, slot_programs) write each local slot at its expert's segment start plus
    its position; the others each take BLOCK positions of the sorted array, write the pad
    value S where no slot goes, and label the M block that starts at each multiple of BLOCK_M
    with its expert (-1 past the live prefix). Disjoint writes: no ordering between programs."""
    pid = tl.program_id(0)
    ce = tl.arange(0, E_P)
    cnt = tl.load(counts_ptr + ce, mask=ce < E, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if pid < slot_programs:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < S
        ex = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int32)
        local = inb & (ex >= 0) & (ex < E)
        pos = tl.load(slot_pos_ptr + offs, mask=local, other=0)
        seg = tl.sum(tl.where(ce[None, :] == ex[:, None], starts[None, :], 0), axis=1)
        tl.store(sorted_ptr + seg + pos, offs.to(tl.int32), mask=local)
    else:
        p = (pid - slot_programs) * BLOCK + tl.arange(0, BLOCK)
        inb = p < L
        # the expert whose padded segment holds position p: how many segments end at or before it
        owner = tl.sum(((ends[None, :] <= p[:, None]) & (ce[None, :] < E)).to(tl.int32), axis=1)
        seg = tl.sum(tl.where(ce[None, :] == owner[:, None], starts[None, :], 0), axis=1)
        live = tl.sum(tl.where(ce[None, :] == owner[:, None], cnt[None, :], 0), axis=1)
        pad = (owner >= E) | (p - seg >= live)
        tl.store(sorted_ptr + p, tl.zeros_like(p) + S, mask=inb & pad)
        first = inb & (p % BLOCK_M == 0)
        tl.store(expert_ids_ptr + p // BLOCK_M, tl.where(owner < E, owner, -1), mask=first)
        if pid == slot_programs:
            tl.store(num_post_ptr, tl.sum(padded, axis=0))


def moe_align_block_size_torch(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` in torch ops: its reference (and the path for zero slots or experts)."""
    dev = topk_ids.device
    s = topk_ids.numel()
    e = num_experts
    length, nblocks = align_sizes(s, e, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < e)
    bucket = torch.where(valid, flat, torch.full_like(flat, e))
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:e] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(bucket, stable=True)
    b_sorted = bucket[order]
    dense_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(s, device=dev) - dense_start[b_sorted]
    starts_ext = torch.cat([starts, torch.full((1,), length, dtype=torch.int64, device=dev)])
    dest = torch.where(b_sorted < e, starts_ext[b_sorted] + rank, torch.full_like(rank, length))
    sorted_ids = torch.full((length + 1,), s, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(nblocks, device=dev, dtype=torch.int64) * block_m
    blk_expert = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(blk_expert < e, blk_expert, torch.full_like(blk_expert, -1)).to(torch.int32)
    num_post = ends[-1:].to(torch.int32) if e > 0 else torch.zeros(1, dtype=torch.int32, device=dev)
    return sorted_ids[:length], expert_ids, num_post


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

ACT_NONE, ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI = 0, 1, 2, 3
Q_NONE, Q_FP8_BLOCK, Q_INT8, Q_FP8_TENSOR = 0, 1, 2, 3
_ACTS = {"none": ACT_NONE, "silu": ACT_SILU, "gelu": ACT_GELU, "swiglu_oai": ACT_SWIGLU_OAI}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_QUANTS = {"none": Q_NONE, "fp8_block": Q_FP8_BLOCK, "int8": Q_INT8, "fp8_tensor": Q_FP8_TENSOR}
# the layer dtype, to which the kernels round intermediates as an unfused kernel stores them
_MID = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program pid -> (M tile, N tile) in grouped order: GROUP_M M tiles in a row share each
    weight tile while it is in L2 (the fused-MoE kernels and the masked grouped GEMM)."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    return first_m + ((pid % in_group) % group_size), (pid % in_group) // group_size


@triton.jit
def _to(x, out_ty: tl.constexpr, FIX_BF16: tl.constexpr):
    """fp32 -> out_ty. FIX_BF16 (interpreter only): its fp32 -> bf16 cast truncates instead of
    rounding to nearest even, so round the fp32 bits first; the cast is then exact."""
    if FIX_BF16:
        if out_ty == tl.bfloat16:
            x = _bf16_grid(x)
    return x.to(out_ty)


@triton.jit
def _bf16_grid(x):
    """fp32 rounded to the nearest bf16 value (ties to even), as fp32, from its bits. NaN stays
    NaN: the carry of a NaN with a large payload wrapped around to a zero."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _round_mid(x, MID: tl.constexpr, FIX_BF16: tl.constexpr):
    """Round fp32 `x` to the layer dtype and back (MID: 0 bf16, 1 fp16, 2 fp32), as an unfused
    kernel's stored intermediate is."""
    if MID == 0:
        x = _to(x, tl.bfloat16, FIX_BF16).to(tl.float32)
    elif MID == 1:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _e4m3_grid(q, MIN_NORMAL: tl.constexpr):
    """Interpreter only: its fp32 -> fp8 cast drops the carry when rounding crosses a power of
    two (31.9 -> 16 instead of 32). Round `q` (within the fp8 range) to the e4m3 grid here,
    ties to even, so that the cast is exact. 3 mantissa bits: step = 2**(exponent - 3); the
    subnormal step below MIN_NORMAL."""
    mag = tl.abs(q)
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(mag, MIN_NORMAL))) - 3.0)
    mag = ((mag / step + 12582912.0) - 12582912.0) * step
    return tl.where(q < 0, -mag, mag)


@triton.jit
def _ceil_pow2(x):
    """UE8M0 scales: the smallest power of two >= each positive normal float32 of `x`, from its
    bits, as `moehal.quant.fp8.ceil_pow2` (exact where `exp2(ceil(log2(x)))` is not: log2 rounds
    to k just above 2^k, and on GPUs it is approximate)."""
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = tl.where(((bits & 0x7FFFFF) != 0) & (e < 0xFF), e + 1, e)
    return tl.where(e == 0xFF, x, (e << 23).to(tl.float32, bitcast=True))


@triton.jit
def _static_fp8(x, scale, QMAX: tl.constexpr, MIN_NORMAL: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """fp32 `x` -> fp8 values (still fp32) with a static per-tensor scale: x / scale, saturated
    to +-QMAX, as `moehal.quant.fp8.quantize_tensor` does. `div_rn`: Triton's `/` is an
    approximate division on NVIDIA GPUs, and a last-bit difference can move a value across a
    rounding boundary of the fp8 grid."""
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -QMAX), QMAX)
    if ROUND_IN_FP32:
        q = _e4m3_grid(q, MIN_NORMAL)
    return q


@triton.jit
def _activation(g, u, alpha, limit, ACT: tl.constexpr, GATED: tl.constexpr):
    if ACT == 3:  # swiglu_oai (always gated)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g * tl.sigmoid(alpha * g) * (u + 1.0)
    if ACT == 1:
        a = g * tl.sigmoid(g)
    else:  # exact (erf) gelu, as torch.nn.functional.gelu
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    if GATED:
        a = a * u
    return a


@fast_launch
@triton.jit
def _fused_moe_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_desc,  # B_TMA: a TensorDescriptor of b, blocks [1, BLOCK_N, BLOCK_K]; else unused
    b_scale_ptr,
    bias_ptr,
    c_ptr,
    c_scale_ptr,  # OUT_Q: the static scale that quantizes the output (fp32 [1])
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_ptr,
    EM,  # length of sorted_ids
    num_valid,
    up_offset,
    alpha,
    limit,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_biase,
    stride_biasn,
    stride_cm,
    stride_cn,
    N: tl.constexpr,  # output columns (I for GEMM1, H for GEMM2)
    K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TOP_K: tl.constexpr,  # A row = slot // TOP_K (1 for GEMM2)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    QUANT: tl.constexpr,
    OUT_Q: tl.constexpr,  # fp8_tensor GEMM1: store the output quantized for GEMM2 (c is fp8)
    MID: tl.constexpr,  # the layer dtype (see `_round_mid`)
    QMAX: tl.constexpr,  # fp8 range (OUT_Q)
    MIN_NORMAL: tl.constexpr,  # smallest normal fp8 value (OUT_Q, interpreter rounding)
    HAS_BIAS: tl.constexpr,
    B_TMA: tl.constexpr,  # weight tiles by TMA (Hopper)
    PAIRED: tl.constexpr,  # GEMM1, gated, unquantized, w13 rows interleaved [g0, u0, g1, u1, ...]: one dot
    UPCAST: tl.constexpr,  # interpreter only: fp32 dot operands (BF16 tl.dot is wrong there)
    IEEE: tl.constexpr,  # fp32 layers: full-precision dot (no TF32)
    FIX_BF16: tl.constexpr,  # interpreter only: see `_to`
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(EM, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    num_post = tl.load(num_post_ptr)
    if pid_m * BLOCK_M >= num_post:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    slot_mask = slot < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    c_ptrs = c_ptr + slot[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = slot_mask[:, None] & n_mask[None, :]

    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:  # a block of an expert that is not on this rank: contributes zeros
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return

    a_row = slot // TOP_K
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk
    bg_ptrs = b_base + offs_n[None, :] * stride_bn
    bu_ptrs = b_base + (offs_n[None, :] + up_offset) * stride_bn
    if PAIRED:
        # 2*BLOCK_N interleaved rows: the gate and up rows of this tile's BLOCK_N columns
        offs_p = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        p_mask = offs_p < 2 * N
        bp_ptrs = b_base + offs_p[None, :] * stride_bn
        acc_p = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)

    if QUANT == 2:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if QUANT == 1:
        as_ptrs = a_scale_ptr + a_row * stride_asm
        bs_base = b_scale_ptr + expert * stride_bse
        bsg_ptrs = bs_base + (offs_n // GROUP_N) * stride_bsn
        bsu_ptrs = bs_base + ((offs_n + up_offset) // GROUP_N) * stride_bsn

    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        if PAIRED:
            if B_TMA:
                bp = b_desc.load([expert.to(tl.int32), pid_n * 2 * BLOCK_N, kb * BLOCK_K])
                bp = bp.reshape(2 * BLOCK_N, BLOCK_K).trans()
            else:
                bp = tl.load(bp_ptrs, mask=k_mask[:, None] & p_mask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                bp = bp.to(tl.float32)
            if IEEE:
                acc_p += tl.dot(a, bp, input_precision="ieee")
            else:
                acc_p += tl.dot(a, bp)
            bp_ptrs += BLOCK_K * stride_bk
        elif B_TMA:
            # Rows past the tensor's end read as zeros; gate rows past N read up rows, into
            # output columns that are never stored.
            n0 = pid_n * BLOCK_N
            bg = b_desc.load([expert.to(tl.int32), n0, kb * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).trans()
            if GATED:
                bu = b_desc.load([expert.to(tl.int32), n0 + up_offset, kb * BLOCK_K])
                bu = bu.reshape(BLOCK_N, BLOCK_K).trans()
        else:
            bg = tl.load(bg_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if GATED:
                bu = tl.load(bu_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST and not PAIRED:
            if QUANT != 2:
                a = a.to(tl.float32)
                bg = bg.to(tl.float32)
                if GATED:
                    bu = bu.to(tl.float32)
        if PAIRED:
            pass  # accumulated above
        elif QUANT == 2:
            acc_g += tl.dot(a, bg, out_dtype=tl.int32)
            if GATED:
                acc_u += tl.dot(a, bu, out_dtype=tl.int32)
        elif QUANT == 1:
            kg = (kb * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=slot_mask, other=0.0)
            bs_g = tl.load(bsg_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
            acc_g += tl.dot(a, bg) * a_s[:, None] * bs_g[None, :]
            if GATED:
                bs_u = tl.load(bsu_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
                acc_u += tl.dot(a, bu) * a_s[:, None] * bs_u[None, :]
        else:
            if IEEE:
                acc_g += tl.dot(a, bg, input_precision="ieee")
                if GATED:
                    acc_u += tl.dot(a, bu, input_precision="ieee")
            else:
                acc_g += tl.dot(a, bg)
                if GATED:
                    acc_u += tl.dot(a, bu)
        a_ptrs += BLOCK_K * stride_ak
        bg_ptrs += BLOCK_K * stride_bk
        bu_ptrs += BLOCK_K * stride_bk

    if QUANT == 2:
        a_s = tl.load(a_scale_ptr + a_row * stride_asm, mask=slot_mask, other=0.0)
        bs_base = b_scale_ptr + expert * stride_bse
        bs_g = tl.load(bs_base + offs_n * stride_bsn, mask=n_mask, other=0.0)
        g = acc_g.to(tl.float32) * a_s[:, None] * bs_g[None, :]
        if GATED:
            bs_u = tl.load(bs_base + (offs_n + up_offset) * stride_bsn, mask=n_mask, other=0.0)
            u = acc_u.to(tl.float32) * a_s[:, None] * bs_u[None, :]
        else:
            u = g
    elif QUANT == 3:
        # per-tensor fp8: one activation scale, one weight scale per expert
        s_ab = tl.load(a_scale_ptr) * tl.load(b_scale_ptr + expert * stride_bse)
        g = acc_g * s_ab
        u = acc_u * s_ab
    elif PAIRED:
        # columns (2j, 2j+1) are (gate j, up j): a thread holds both in its registers
        g, u = tl.split(tl.reshape(acc_p, (BLOCK_M, BLOCK_N, 2)))
    else:
        g = acc_g
        u = acc_u

    if HAS_BIAS:
        bias_base = bias_ptr + expert * stride_biase
        g += tl.load(bias_base + offs_n * stride_biasn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            u += tl.load(bias_base + (offs_n + up_offset) * stride_biasn, mask=n_mask, other=0.0).to(tl.float32)[
                None, :
            ]

    out_ty = c_ptr.dtype.element_ty
    # Round like the stored intermediates of an unfused kernel (and the reference) do.
    g = _round_mid(g, MID, FIX_BF16)
    if ACT != 0:
        if GATED:
            u = _round_mid(u, MID, FIX_BF16)
        g = _activation(g, u, alpha, limit, ACT, GATED)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + slot, mask=slot_mask, other=0.0).to(tl.float32)
        g = g * w[:, None]
    if OUT_Q:
        # the activation as the layer dtype stores it, then quantized for GEMM2
        g = _static_fp8(_round_mid(g, MID, FIX_BF16), tl.load(c_scale_ptr), QMAX, MIN_NORMAL, FIX_BF16)
        tl.store(c_ptrs, g.to(out_ty), mask=c_mask)
    else:
        tl.store(c_ptrs, _to(g, out_ty, FIX_BF16), mask=c_mask)


@fast_launch
@triton.jit
def _group_quant_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    QMAX: tl.constexpr,
    UE8M0: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    row_ids_ptr,
    HAS_ROW_IDS: tl.constexpr,
    STATIC: tl.constexpr = False,
):
    """One program per (row, 128-group): scale = amax / QMAX, q = x / scale (saturated).
    With HAS_ROW_IDS, rows whose expert id is < 0 (not local, never written) are skipped.
    STATIC: the scale is the one at `s_ptr` (per-tensor fp8, from the checkpoint), not stored."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROW_IDS:
        if tl.load(row_ids_ptr + row) < 0:
            return
    grp = tl.program_id(1)
    offs = grp * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        q = _static_fp8(x, tl.load(s_ptr), QMAX, MIN_NORMAL, ROUND_IN_FP32)
    else:
        amax = tl.max(tl.abs(x), axis=0)
        # div_rn: Triton's `/` is approximate on GPUs; the scale and the quotients are the
        # reference's, bit for bit (a quotient one ulp off breaks the fp8 grid's ties the other
        # way, and bf16 inputs put many values on ties: docs/device-runs/2026-11-28-session48)
        scale = tl.div_rn(tl.maximum(amax, 1e-12), QMAX)
        if UE8M0:
            scale = _ceil_pow2(scale)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -QMAX), QMAX)
        if ROUND_IN_FP32:
            q = _e4m3_grid(q, MIN_NORMAL)
        tl.store(s_ptr + row * stride_sm + grp, scale)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _token_quant_int8_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, row_ids_ptr, HAS_ROW_IDS: tl.constexpr, BLOCK: tl.constexpr
):
    """One program per row: scale = amax / 127, q = round-half-even(x / scale). With HAS_ROW_IDS,
    rows whose expert id is < 0 are skipped."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROW_IDS:
        if tl.load(row_ids_ptr + row) < 0:
            return
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.div_rn(tl.maximum(amax, 1e-12), 127.0)  # IEEE, as the reference (see the fp8 quantizer)
    y = tl.div_rn(x, scale)
    # Round half to even without libdevice (portable to HIP and the interpreter): adding and
    # subtracting 1.5 * 2**23 rounds an fp32 |y| < 2**22 to the nearest integer, ties to even.
    y = (y + 12582912.0) - 12582912.0
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(q_ptr + row * stride_qm + offs, y.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


@fast_launch
@triton.jit
def _moe_sum_kernel(
    c_ptr,
    ids_ptr,
    out_ptr,
    T,
    H,
    E,
    stride_cm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """out[t] = sum_k c[t*K + k] over the k whose expert is local (0 <= id < E); fp32 sum. The
    align pass leaves the rows of other ids unwritten, so they must not be read either."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = offs_t < T
    h_mask = offs_h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + offs_t * TOP_K + k, mask=t_mask, other=-1)
        m = (t_mask & (e >= 0) & (e < E))[:, None] & h_mask[None, :]
        ptrs = c_ptr + (offs_t * TOP_K + k)[:, None] * stride_cm + offs_h[None, :]
        acc += tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs_t[:, None] * stride_om + offs_h[None, :]
    tl.store(out_ptrs, _to(acc, out_ptr.dtype.element_ty, FIX_BF16), mask=t_mask[:, None] & h_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def per_token_group_quant_fp8(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    ue8m0: bool = False,
    row_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (fp8 `[M, K]`, fp32 scales `[M, ceil(K/128)]`), 1x128 groups.
    row_ids int32 `[M]`: rows with a negative id are skipped (their outputs stay unset)."""
    m, k = x.shape
    return bind_row_quant("fp8_group", m, k, fp8_dtype, ue8m0=ue8m0, row_ids=row_ids is not None)(x, row_ids)


def _min_normal(fp8_dtype: torch.dtype) -> float:
    return 2.0**-7 if fp8_dtype == torch.float8_e4m3fnuz else 2.0**-6


def per_token_quant_int8(x: torch.Tensor, row_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (int8 `[M, K]`, fp32 scales `[M]`), dynamic symmetric per row.
    row_ids int32 `[M]`: rows with a negative id are skipped (their outputs stay unset)."""
    m, k = x.shape
    return bind_row_quant("int8", m, k, torch.int8, row_ids=row_ids is not None)(x, row_ids)


def bind_row_quant(
    mode: str, m: int, k: int, qdtype: torch.dtype, *, ue8m0: bool = False, row_ids: bool = False
) -> RowQuant:
    """A row quantizer's launch for `[m, k]` inputs, decided once. mode: 'fp8_group' (1x128
    groups, `per_token_group_quant_fp8`), 'fp8_static' (one static scale: x / scale, saturated,
    as `moehal.quant.fp8.quantize_tensor` does) or 'int8' (per row, `per_token_quant_int8`). row_ids: the calls
    pass the rows' expert ids, and rows with a negative id are skipped."""
    if mode == "int8":
        block = next_power_of_2(k)
        kw: dict[str, Any] = dict(HAS_ROW_IDS=row_ids, BLOCK=block, num_warps=min(16, max(1, block // 256)))
        return RowQuant(mode, m, k, qdtype, (m,), (m,), (), kw)
    if mode not in ("fp8_group", "fp8_static"):
        raise ValueError(f"unknown row quantizer {mode!r}")
    static = mode == "fp8_static"
    consts = (fp8_qmax(qdtype), ue8m0 and not static, GROUP, _min_normal(qdtype), INTERPRETED)
    # constants by position and no tensor by keyword: the fast launcher's cheapest key
    kw = dict(HAS_ROW_IDS=row_ids and not static, STATIC=static)
    return RowQuant(mode, m, k, qdtype, () if static else (m, cdiv(k, GROUP)), (m, cdiv(k, GROUP)), consts, kw)


@dataclass(frozen=True)
class RowQuant:
    """One row quantizer for one input shape (`bind_row_quant`)."""

    mode: str
    rows: int
    cols: int
    qdtype: torch.dtype
    scale_shape: tuple[int, ...]  # () for 'fp8_static' (the scale is the caller's)
    grid: tuple[int, ...]
    consts: tuple[Any, ...]  # the fp8 kernel's constexprs between its strides and row ids
    kw: dict[str, Any]

    def __call__(
        self, x: torch.Tensor, row_ids: torch.Tensor | None = None, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[M, K]` -> (quantized `[M, K]`, scales); `scale`: the static fp32 `[1]` scale
        ('fp8_static', returned as the scales); `row_ids` int32 `[M]` exactly when bound so."""
        m, k = self.rows, self.cols
        if x.stride(-1) != 1:  # the kernels step rows by x.stride(0) and columns by 1
            x = x.contiguous()
        q = torch.empty((m, k), dtype=self.qdtype, device=x.device)
        if self.mode == "fp8_static":
            assert scale is not None, "a static fp8 quantizer takes its scale"
            s = scale
        else:
            s = torch.empty(self.scale_shape, dtype=torch.float32, device=x.device)
        if not (m and k):
            return q, s
        ids = row_ids if row_ids is not None else s
        if self.mode == "int8":
            self._site(x, q, s, k, x.stride(0), q.stride(0), ids)
        else:
            stride_s = 0 if self.mode == "fp8_static" else s.stride(0)
            self._site(x, q, s, k, x.stride(0), q.stride(0), stride_s, *self.consts, ids)
        return q, s

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_token_quant_int8_kernel if self.mode == "int8" else _group_quant_fp8_kernel, self.grid, **self.kw)


@dataclass(frozen=True)
class TritonMoEWeights:
    """Weights as the kernel reads them: the canonical layout (w13 `[E, N13, H]` = [gate; up],
    w2 `[E, H, I]`, i.e. `[E, N, K]` for both GEMMs), fp8 in the hardware's flavour.

    quant: 'none' | 'fp8_block' | 'fp8_tensor' | 'int8'. Scales: fp8_block
    `[E, ceil(N/128), ceil(K/128)]`, fp8_tensor `[E]` (and static activation scales a13_scale,
    a2_scale, fp32 `[1]`), int8 `[E, N]`. Biases in fp32.

    w13_paired: w13's rows interleaved, `[g0, u0, g1, u1, ...]` (`pair_gate_up`; unquantized
    gated weights only, biases stay canonical): GEMM1 then reads one `2*BLOCK_N`-row tile and
    runs one dot per K step, where the canonical layout takes two (gate, up) that each read
    the activation tile again."""

    w13: torch.Tensor
    w2: torch.Tensor
    quant: str = "none"
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    ue8m0: bool = False
    w13_paired: bool = False
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.w13.dtype


def pair_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """Canonical gated w13 `[E, 2I, H]` ([gate; up]) -> rows interleaved `[g0, u0, g1, u1, ...]`
    (a new tensor): the layout `TritonMoEWeights.w13_paired` names."""
    e, n2, h = w13.shape
    return w13.reshape(e, 2, n2 // 2, h).transpose(1, 2).reshape(e, n2, h).contiguous()  # any strides in


def tma_weights_ok(b: torch.Tensor, cfg: TileConfig, paired: bool = False) -> bool:
    """Whether weights `[E, N, K]` can be read by TMA with this tile: an NVIDIA GPU of SM90 or
    newer (or the interpreter, which emulates descriptors), a Triton with host-side tensor
    descriptors, the last dim contiguous, the other strides and the base 16-byte aligned, and
    blocks of at most 256 per dim and at least 16 bytes along K (the TMA box limits; a paired
    GEMM1 tile holds `2*BLOCK_N` rows). Where not, a TMA tile runs with pointer loads: the
    same result, only the load path differs."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    if b.dim() != 3 or b.stride(2) != 1 or cfg.block_n * (2 if paired else 1) > 256 or cfg.block_k > 256:
        return False
    size = b.element_size()
    if (b.stride(0) * size) % 16 or (b.stride(1) * size) % 16 or b.data_ptr() % 16 or cfg.block_k * size < 16:
        return False
    if b.device.type == "cpu":
        return interpreting()
    return b.device.type == "cuda" and torch.version.hip is None and _cuda_major(b.device.index) >= 9


@functools.lru_cache(maxsize=16)
def _cuda_major(index: int | None) -> int:
    """The compute capability's major version (asked once per device: a launch asks it)."""
    return torch.cuda.get_device_capability(index)[0]


def _weight_descriptor(b: torch.Tensor, cfg: TileConfig, paired: bool = False) -> Any:
    """The TMA descriptor of weights `[E, N, K]` for `[1, BLOCK_N, BLOCK_K]` tiles (`2*BLOCK_N`
    rows when paired; a small host object whose CUtensorMap is encoded at launch and, in a CUDA
    graph, kept by the graph)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = cfg.block_n * (2 if paired else 1)
    return TensorDescriptor(b, list(b.shape), list(b.stride()), [1, rows, cfg.block_k])


def bind_gemm(
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    em: int,
    num_valid: int,
    n: int,
    k: int,
    cfg: TileConfig,
    *,
    a_dtype: torch.dtype,
    top_k: int,
    gated: bool,
    act: int,
    quant: int,
    alpha: float,
    limit: float,
    weighted: bool,
    paired: bool = False,
    c_scale: torch.Tensor | None = None,
    c_dtype: torch.dtype | None = None,
    mid_dtype: torch.dtype = torch.bfloat16,
) -> GemmLaunch:
    """One grouped GEMM over the sorted tiles (`em` sorted slots, `num_valid` live ones) of the
    weights `b` `[E, N, K]`, decided once: grid, weight operands (the TMA descriptor, when the
    tile asks for it and `tma_weights_ok` agrees), strides and constants. a_dtype: the dtype
    of A (fp32 layers take full-precision dots); weighted: the calls pass router weights
    (MUL_ROUTED_WEIGHT). c_scale (fp8_tensor GEMM1): C is fp8 of `c_dtype` and the epilogue
    quantizes with this static scale; mid_dtype: the layer dtype."""
    grid = (cdiv(em, cfg.block_m) * cdiv(n, cfg.block_n),)
    b_s = b_scale if b_scale is not None else b  # pointers of disabled features: never read
    if b_scale is not None:
        bse = b_scale.stride(0)
        bsn = b_scale.stride(1) if b_scale.dim() > 1 else 0
        bsk = b_scale.stride(2) if b_scale.dim() > 2 else 0
    else:
        bse = bsn = bsk = 0
    bias_t = bias if bias is not None else b
    bie, bin_ = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    b_tma = cfg.tma and tma_weights_ok(b, cfg, paired)
    out_q = c_scale is not None
    if out_q and c_dtype is None:
        raise ValueError("a GEMM that quantizes its output (c_scale) needs the output's fp8 dtype")
    return GemmLaunch(
        grid,
        (b, _weight_descriptor(b, cfg, paired) if b_tma else b, b_s, bias_t),
        c_scale if out_q else b,
        (em, num_valid, n if gated else 0, alpha, limit),
        (*b.stride(), bse, bsn, bsk, bie, bin_),
        weighted,
        dict(
            N=n, K=k, GROUP_N=GROUP, GROUP_K=GROUP, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, TOP_K=top_k, MUL_ROUTED_WEIGHT=weighted, GATED=gated,
            ACT=act, QUANT=quant, OUT_Q=out_q, MID=_MID[mid_dtype],
            QMAX=fp8_qmax(c_dtype) if out_q else 0.0,  # type: ignore[arg-type]
            MIN_NORMAL=_min_normal(c_dtype) if out_q else 0.0,  # type: ignore[arg-type]
            HAS_BIAS=bias is not None, B_TMA=b_tma, PAIRED=paired, UPCAST=INTERPRETED,
            IEEE=a_dtype == torch.float32, FIX_BF16=INTERPRETED, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class GemmLaunch:
    """One `_fused_moe_kernel` launch with everything but the call's tensors decided
    (`bind_gemm`)."""

    grid: tuple[int]
    weights: tuple[Any, ...]  # b, its TMA descriptor (or b), its scales (or b), the bias (or b)
    c_scale: torch.Tensor  # OUT_Q's static scale (or b: unused)
    scalars: tuple[Any, ...]  # sorted length, live slots, the up half's offset, alpha, limit
    b_strides: tuple[int, ...]  # b's three, its scales' three, the bias's two
    weighted: bool
    kw: dict[str, Any]

    def __call__(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        c: torch.Tensor,
        topk_weights: torch.Tensor | None,
        sorted_ids: torch.Tensor,
        expert_ids: torch.Tensor,
        num_post: torch.Tensor,
    ) -> None:
        """A `[rows, K]` (its scales: `[rows, K/128]`, `[rows]` or `[1]`), C `[slots, N]` with
        contiguous rows; topk_weights fp32 `[slots]` exactly when bound weighted."""
        b = self.weights[0]
        if a_scale is None:
            a_s, asm, ask = b, 0, 0
        else:
            a_s, asm, ask = a_scale, a_scale.stride(0), a_scale.stride(1) if a_scale.dim() > 1 else 0
        self._site(
            a, a_s, *self.weights, c, self.c_scale, topk_weights if self.weighted else b, sorted_ids, expert_ids,
            num_post, *self.scalars, *a.stride(), asm, ask, *self.b_strides, *c.stride(),
        )  # fmt: skip

    @functools.cached_property
    def _site(self) -> Site:  # the pinned launch (host time: `moehal.kernels.launch.Site`)
        return site(_fused_moe_kernel, self.grid, **self.kw)


def bind_fused_moe(
    tokens: int,
    top_k: int,
    w: TritonMoEWeights,
    *,
    activation: str = "silu",
    gated: bool = True,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    out_dtype: torch.dtype = torch.bfloat16,
    hidden_dtype: torch.dtype | None = None,
    quantized_input: bool = False,
    all_local: bool = False,
    configs: tuple[TileConfig, TileConfig] | None = None,
    device_name: str | None = None,
    is_rocm: bool = False,
) -> BoundFusedMoE:
    """`fused_moe`'s launches for `tokens` tokens of `top_k` slots on the weights `w`: tiles,
    sizes, grids, the weights' TMA descriptors and every argument but the call's tensors,
    decided once. An experts runner keeps one per token count (the host time of an eager
    forward); `fused_moe` binds and calls in one go.

    hidden_dtype: the dtype of the calls' hidden states (default out_dtype; fp8 or int8 when
    quantized_input, i.e. the calls pass their scales)."""
    h = w.w2.shape[1]
    e, n13 = w.w13.shape[0], w.w13.shape[1]
    i = w.w2.shape[2]
    hidden_dtype = hidden_dtype or out_dtype
    if w.w13_paired and (w.quant != "none" or not gated or n13 != 2 * i):
        raise ValueError("w13_paired holds unquantized gated weights only (gate and up rows interleaved)")
    if configs is None:
        dname = _DTYPE_NAMES.get(out_dtype, "bf16")
        configs = select_configs(tokens, e, h, i, top_k, w.quant, dname, device_name, is_rocm)
    cfg1, cfg2 = configs
    s = tokens * top_k
    live = tokens > 0 and e > 0
    static = w.quant == "fp8_tensor"  # GEMM1 stores its output quantized (no pass between)
    quant1 = quant2 = None
    if live and not quantized_input and w.quant != "none":
        mode = {"fp8_tensor": "fp8_static", "fp8_block": "fp8_group", "int8": "int8"}[w.quant]
        quant1 = bind_row_quant(mode, tokens, h, w.w13.dtype, ue8m0=w.ue8m0)  # (fp8 or int8, as the weights)
    if live and w.quant in ("fp8_block", "int8"):  # rows of remote experts are never written: skipped
        quant2 = bind_row_quant(
            "fp8_group" if w.quant == "fp8_block" else "int8", s, i, w.w13.dtype, ue8m0=w.ue8m0, row_ids=not all_local,
        )  # fmt: skip
    a1_dtype = quant1.qdtype if quant1 is not None else hidden_dtype
    qcode = _QUANTS[w.quant]
    align = bind_align(s, e, cfg1.block_m) if live else None
    em = align.length if align else 0
    gemm1 = bind_gemm(
        w.w13, w.w13_scale, w.w13_bias, em, s, i, h, cfg1, a_dtype=a1_dtype, top_k=top_k,
        gated=gated and n13 == 2 * i, act=_ACTS[activation], quant=qcode, alpha=swiglu_alpha, limit=swiglu_limit,
        weighted=False, paired=w.w13_paired, c_scale=w.a2_scale if static else None,
        c_dtype=w.fp8_dtype if static else out_dtype, mid_dtype=out_dtype,
    )  # fmt: skip
    inter_dtype = w.fp8_dtype if static else out_dtype
    a2_dtype = quant2.qdtype if quant2 else inter_dtype
    gemm2 = bind_gemm(
        w.w2, w.w2_scale, w.w2_bias, em, s, h, i, cfg2, a_dtype=a2_dtype, top_k=1, gated=False, act=ACT_NONE,
        quant=qcode, alpha=0.0, limit=0.0, weighted=True, mid_dtype=out_dtype,
    )  # fmt: skip
    block_t = min(64, next_power_of_2(tokens)) if INTERPRETED else 1
    block_h = min(4096 if INTERPRETED else 1024, next_power_of_2(h))
    return BoundFusedMoE(
        tokens, top_k, h, i, e, out_dtype, hidden_dtype, quantized_input, all_local, top_k == 1 and all_local,
        w, configs, align, quant1, gemm1, inter_dtype, quant2, gemm2,
        (cdiv(tokens, block_t), cdiv(h, block_h)) if live else (0, 0),
        dict(TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, FIX_BF16=INTERPRETED),
    )  # fmt: skip


@dataclass(frozen=True)
class BoundFusedMoE:
    """`fused_moe` for one token count, top-k and set of weights (`bind_fused_moe`). A call
    allocates what it returns and its intermediates, and launches: the align pass (two or
    three kernels), the input's quantization (quantized schemes, unless the caller quantized),
    GEMM1, the intermediate's quantization (fp8 block and int8), GEMM2 and the top-k sum."""

    tokens: int
    top_k: int
    hidden: int
    intermediate: int
    experts: int
    out_dtype: torch.dtype
    hidden_dtype: torch.dtype
    quantized_input: bool
    all_local: bool
    direct: bool  # top-1 with every expert local: GEMM2 writes the output rows itself
    w: TritonMoEWeights
    configs: tuple[TileConfig, TileConfig]
    align: AlignLaunch | None  # None: no tokens or no experts
    quant1: RowQuant | None
    gemm1: GemmLaunch
    inter_dtype: torch.dtype
    quant2: RowQuant | None
    gemm2: GemmLaunch
    sum_grid: tuple[int, int]
    sum_kw: dict[str, Any]

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        hidden_scales: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden `[T, H]` of the bound dtype (and its scales exactly when bound for quantized
        input), topk_ids `[T, K]` local ids (-1: not on this rank), topk_weights `[T, K]`;
        out: `[T, H]` of out_dtype with contiguous rows, not `hidden` itself (None: a new
        tensor). Returns the `[T, H]` result."""
        t, h = self.tokens, self.hidden
        if (
            hidden.shape != (t, h) or topk_ids.shape != (t, self.top_k) or hidden.dtype != self.hidden_dtype
            or topk_weights.shape != topk_ids.shape or (hidden_scales is not None) != self.quantized_input
        ):  # fmt: skip
            raise ValueError(
                f"a fused MoE bound for [{t}, {h}] {self.hidden_dtype} hidden states of top-{self.top_k} "
                f"({'with' if self.quantized_input else 'without'} scales) got {list(hidden.shape)} {hidden.dtype} "
                f"of top-{topk_ids.shape[-1]} with weights {list(topk_weights.shape)} "
                f"({'with' if hidden_scales is not None else 'without'} scales)"
            )
        dev = hidden.device
        if out is None:
            out = torch.empty((t, h), dtype=self.out_dtype, device=dev)
        elif out.shape != (t, h) or out.dtype != self.out_dtype or out.stride(-1) != 1:
            raise ValueError(
                f"out must be [{t}, {h}] {self.out_dtype} with contiguous rows, got {tuple(out.shape)} {out.dtype}"
            )
        align = self.align
        if align is None:
            return out if t == 0 else out.zero_()
        w = self.w
        ids = topk_ids.reshape(-1)
        if ids.dtype != torch.int32 or not ids.is_contiguous():
            ids = ids.to(torch.int32).contiguous()
        sorted_ids, expert_ids, num_post = align(ids)
        if self.quant1 is not None:
            a1, a1_s = self.quant1(hidden, None, w.a13_scale)
        else:
            a1, a1_s = hidden, hidden_scales
        s = t * self.top_k
        inter = torch.empty((s, self.intermediate), dtype=self.inter_dtype, device=dev)
        self.gemm1(a1, a1_s, inter, None, sorted_ids, expert_ids, num_post)
        if self.quant2 is not None:
            a2, a2_s = self.quant2(inter, None if self.all_local else ids)
        else:  # unquantized, or fp8_tensor: GEMM1 stored it quantized with the static scale
            a2, a2_s = inter, w.a2_scale
        y = out if self.direct else torch.empty((s, h), dtype=self.out_dtype, device=dev)
        tw = topk_weights.reshape(-1)
        if tw.dtype != torch.float32 or not tw.is_contiguous():
            tw = tw.to(torch.float32).contiguous()
        self.gemm2(a2, a2_s, y, tw, sorted_ids, expert_ids, num_post)
        if not self.direct:
            self._sum_site(y, ids, out, t, h, self.experts, y.stride(0), out.stride(0))
        return out

    @functools.cached_property
    def _sum_site(self) -> Site:  # the pinned top-k sum (host time: `moehal.kernels.launch.Site`)
        return site(_moe_sum_kernel, self.sum_grid, **self.sum_kw)


def fused_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: TritonMoEWeights,
    *,
    activation: str = "silu",
    gated: bool = True,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    out_dtype: torch.dtype | None = None,
    hidden_scales: torch.Tensor | None = None,
    all_local: bool = False,
    configs: tuple[TileConfig, TileConfig] | None = None,
    device_name: str | None = None,
    is_rocm: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The STANDARD-layout MoE: `[T, H]` = sum_k weight[t,k] * expert_{ids[t,k]}(hidden[t]).

    hidden `[T, H]` in out_dtype, or already quantized (fp8 of `w.fp8_dtype` with 1x128 scales,
    fp8 with the static scale `w.a13_scale` (fp8_tensor), or int8 with per-token scales) when
    `hidden_scales` is given.
    topk_ids `[T, K]` local ids, -1 for experts not on this rank (they contribute nothing);
    topk_weights `[T, K]` float. all_local: the caller guarantees no -1 (lets top_k == 1
    write straight into the output). out: `[T, H]` of out_dtype with contiguous rows, not
    `hidden` itself, to write the result into (None: a new tensor). No host synchronization;
    every size is static. (`bind_fused_moe` decides the launches; this binds and calls in one
    go.)
    """
    if hidden_scales is not None and out_dtype is None:  # quantized input: its dtype is no output dtype
        raise ValueError("fused_moe on quantized hidden states (hidden_scales given) needs out_dtype")
    bound = bind_fused_moe(
        hidden.shape[0], topk_ids.shape[1], w, activation=activation, gated=gated, swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit, out_dtype=out_dtype or hidden.dtype, hidden_dtype=hidden.dtype,
        quantized_input=hidden_scales is not None, all_local=all_local, configs=configs, device_name=device_name,
        is_rocm=is_rocm,
    )  # fmt: skip
    return bound(hidden, topk_ids, topk_weights, hidden_scales, out)
