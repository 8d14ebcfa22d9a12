"""Dispatch formats: the data that flows dispatch -> apply -> combine.

The experts kernel declares the `ActivationFormat` it consumes; the dispatcher is configured
to produce exactly that. Three layouts are defined by the core; a plugin may declare its own
layout name (e.g. Ascend's flat low-latency layout) for pairs of its own dispatcher and experts.

Who applies the router weights is fixed per layout, so no flag is needed:
- STANDARD: experts compute the whole layer for local experts and return `[T, H]` already
  weighted and summed over k. Combine only applies `routed_scaling_factor` (and, with EP,
  returns the rows to their ranks).
- CONTIGUOUS and MASKED: experts return one unweighted row per dispatched row; combine
  gathers, weights by the router weight, sums over k and applies `routed_scaling_factor`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

__all__ = [
    "ActivationFormat",
    "CombineInput",
    "ContiguousInput",
    "ContiguousOutput",
    "DispatchOutput",
    "Layout",
    "MaskedInput",
    "MaskedOutput",
    "ScaleKind",
    "SmallBatchFormat",
    "StandardInput",
    "StandardOutput",
    "padding_rows",
    "with_dirty_padding",
]


class Layout(str, enum.Enum):
    """How dispatched tokens are laid out for an experts kernel (see docs/architecture.md)."""

    STANDARD = "standard"  # token-major [T, H] plus top-k ids (local ids, -1 = not on this rank)
    CONTIGUOUS = "contiguous"  # expert-sorted rows [M_pad, H], segments aligned, per-row expert id
    MASKED = "masked"  # [E_local, max_m, H] plus masked_m (the DeepEP low-latency layout)


class ScaleKind(str, enum.Enum):
    """How dispatched activations are scaled (if they are quantized)."""

    NONE = "none"  # unquantized
    GROUP_128 = "group128"  # fp8 e4m3, one fp32 scale per 128 elements of a row
    GROUP_128_UE8M0 = "group128_ue8m0"  # same, scales powers of two
    PER_TOKEN = "per_token"  # int8, one fp32 scale per row
    # fp8 e4m3 quantized with the layer's static input scale (the fp8_tensor scheme's
    # calibrated `a13_scale`, which the layer hands the dispatcher: `DispatchRunner.
    # load_input_scale`). The scales tensor is laid out as GROUP_128's and holds that scale in
    # every group, so grouped GEMMs that read 1x128 scales (DeepGEMM) take it as it is.
    STATIC_TENSOR = "static_tensor"


# The strings `ActivationFormat(scales=...)` takes for a `ScaleKind` (for type checkers; the test of
# the config types keeps them equal to the enum's values)
_ScaleKindName = Literal["none", "group128", "group128_ue8m0", "per_token", "static_tensor"]


@dataclass(frozen=True, slots=True)
class ActivationFormat:
    """What an experts kernel consumes, and so what its dispatcher must produce.

    layout: a `Layout`, or a plugin-defined layout name.
    dtype: dtype of the dispatched hidden states (bf16/fp16/fp32, float8_e4m3fn, int8).
    scales: scale kind; NONE for unquantized dtypes.
    row_alignment: CONTIGUOUS: each expert's segment starts at a multiple of this.
        MASKED: max_m (rows per expert) is a multiple of this (GEMM tiles must not
        straddle two experts' rows: DeepGEMM's masked GEMM writes whole tiles).
    """

    layout: Layout | str
    dtype: torch.dtype
    scales: ScaleKind = ScaleKind.NONE
    row_alignment: int = 1

    if TYPE_CHECKING:
        # For type checkers only; at run time the dataclass makes __init__ from the fields. It
        # takes `scales` as a string too ("group128"), which __post_init__ converts, so that
        # `fmt.scales` still reads as a `ScaleKind`. tests/core/test_config_types.py keeps it
        # equal to the fields.
        def __init__(
            self,
            layout: Layout | str,
            dtype: torch.dtype,
            scales: ScaleKind | _ScaleKindName = ScaleKind.NONE,
            row_alignment: int = 1,
        ) -> None: ...

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "layout", Layout(self.layout))
        except ValueError:
            pass  # a plugin-defined layout name
        object.__setattr__(self, "scales", ScaleKind(self.scales))

    @property
    def layout_name(self) -> str:
        return self.layout.value if isinstance(self.layout, Layout) else str(self.layout)

    @property
    def is_quantized(self) -> bool:
        return self.scales is not ScaleKind.NONE

    def unquantized(self, dtype: torch.dtype) -> ActivationFormat:
        return ActivationFormat(self.layout, dtype, ScaleKind.NONE, self.row_alignment)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        sc = "" if self.scales is ScaleKind.NONE else f"+{self.scales.value}"
        al = f" align {self.row_alignment}" if self.row_alignment > 1 else ""
        return f"{self.layout_name}[{dt}{sc}{al}]"


@dataclass(frozen=True, slots=True)
class SmallBatchFormat:
    """A second format an experts kernel consumes for batches of at most `max_tokens` tokens
    (decode steps), where another layout saves launches the main one needs (e.g. token-major
    kernels skip the permute and the gather that grouping rows by expert costs), and, when
    `prefill_min_tokens` is set, for batches of `prefill_min_tokens` to `prefill_max_tokens`
    tokens too (None: no upper bound; prefill, where a kernel that gathers rows itself measured
    faster than permuting them first).

    The layer dispatches a batch in this format when `takes(tokens)` and the pipeline's
    dispatcher can produce it exactly; otherwise in the main format. `why` is shown by
    `moehal explain`."""

    fmt: ActivationFormat
    max_tokens: int
    why: str = ""
    prefill_min_tokens: int | None = None
    prefill_why: str = ""
    prefill_max_tokens: int | None = None

    def takes(self, tokens: int) -> bool:
        """Whether a batch of `tokens` tokens is dispatched in this format."""
        if tokens <= self.max_tokens:
            return True
        lo, hi = self.prefill_min_tokens, self.prefill_max_tokens
        return lo is not None and tokens >= lo and (hi is None or tokens <= hi)

    @property
    def prefill_range(self) -> str:
        """The prefill band in words ('' when none): '>= 64' or '64-724'."""
        lo, hi = self.prefill_min_tokens, self.prefill_max_tokens
        if lo is None:
            return ""
        return f">= {lo}" if hi is None else f"{lo}-{hi}"

    def __str__(self) -> str:
        sizes = [f"<= {self.max_tokens}"] if self.max_tokens > 0 else []
        if self.prefill_min_tokens is not None:
            sizes.append(self.prefill_range)
        return f"{self.fmt} at {' and '.join(sizes) or 'no'} tokens"


# --- dispatch outputs (experts inputs) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StandardInput:
    """Token-major. hidden `[T, H]`; scales `[T, H/128]` or `[T]` when quantized;
    topk_ids int32 `[T, K]` *local* expert ids with -1 for experts not on this rank;
    topk_weights fp32 `[T, K]` (ones when the router weight was applied on the input)."""

    hidden: torch.Tensor
    scales: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


@dataclass(frozen=True, slots=True)
class ContiguousInput:
    """Expert-sorted rows. hidden `[M_pad, H]`; scales `[M_pad, H/128]` or `[M_pad]`;
    row_expert int32 `[M_pad]`: the local expert of each valid row, -1 for the padding rows
    that align each segment and for the unused tail (DeepGEMM's `m_indices`: its SM90 FP8
    kernel skips the 64-row half of a tile whose first row is -1). A segment's valid rows come
    first, so every row at a multiple of the alignment inside a segment is valid. Consumers
    tell live rows by `row_expert >= 0`. counts int32 `[E_local]` valid rows per expert;
    segment_start int32 `[E_local]` first row of each expert.
    M_pad is a static worst case (T*K + E_local*(alignment-1), rounded up), never read
    back to the host. Padding rows hold zeros from moehal's dispatchers (as masked ones, experts
    must not depend on it: `MaskedInput`). Where the dispatcher knows on the host that a
    batch has no slots (0 tokens, an EP rank that received none), M_pad should be 0: experts
    then return at once. A batch whose slots all belong to other ranks is known only on the
    device: it has rows, every one -1, and every segment empty. Experts must return zeros for
    it without faulting (conformance's `shapes/.../no_local_slots`; DeepGEMM's SM90 psum path
    does, docs/device-runs/2026-11-25-session34)."""

    hidden: torch.Tensor
    scales: torch.Tensor | None
    row_expert: torch.Tensor
    counts: torch.Tensor
    segment_start: torch.Tensor

    def live_rows(self) -> torch.Tensor:
        """bool `[M_pad]`: the rows that hold a token, from `segment_start` and `counts` alone
        (what `row_expert >= 0` must say; a check for conformance and tests, not the hot path)."""
        r = torch.arange(self.hidden.shape[0], device=self.hidden.device)[:, None]
        start = self.segment_start.long()[None, :]
        return ((r >= start) & (r < start + self.counts.long()[None, :])).any(dim=1)


@dataclass(frozen=True, slots=True)
class MaskedInput:
    """Per-expert batches. hidden `[E_local, max_m, H]`; scales `[E_local, max_m, H/128]`
    or `[E_local, max_m]`; masked_m int32 `[E_local]` valid rows of each expert;
    expected_m: host int, a tuning hint only (average rows per expert);
    max_total_rows: host int >= sum(masked_m) when the dispatcher knows one (T * top_k on one
    GPU), else None; lets experts size grids by the call rather than by the buffer. Rows past
    masked_m are padding. What they hold is the dispatcher's: moehal's dispatchers write zeros
    there, while DeepEP's low-latency receive buffer keeps whatever it held
    (`Dispatcher.zero_padding`). Experts must not let padding rows reach live ones
    (conformance's padding cases fill them with NaN: `with_dirty_padding`), and must leave
    zeros in their output's padding rows."""

    hidden: torch.Tensor
    scales: torch.Tensor | None
    masked_m: torch.Tensor
    expected_m: int
    max_total_rows: int | None = None

    @property
    def total_rows_bound(self) -> int:
        """A host-side bound on sum(masked_m): `max_total_rows`, or the whole buffer."""
        e, m = self.hidden.shape[0], self.hidden.shape[1]
        return e * m if self.max_total_rows is None else min(self.max_total_rows, e * m)


DispatchOutput = StandardInput | ContiguousInput | MaskedInput | Any


# --- experts outputs (combine inputs) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StandardOutput:
    """`[T, H]`: weighted and summed over k, before routed scaling; `scaled`: the experts
    already applied `routed_scaling_factor` in their last kernel (combine must not again)."""

    hidden: torch.Tensor
    scaled: bool = False


@dataclass(frozen=True, slots=True)
class ContiguousOutput:
    """`[M_pad, H]`: one unweighted row per dispatched row."""

    hidden: torch.Tensor


@dataclass(frozen=True, slots=True)
class MaskedOutput:
    """`[E_local, max_m, H]`: unweighted; rows past masked_m are zeros."""

    hidden: torch.Tensor


CombineInput = StandardOutput | ContiguousOutput | MaskedOutput | Any


def padding_rows(inp: MaskedInput | ContiguousInput) -> torch.Tensor:
    """bool mask of the input's padding rows: `[E_local, max_m]` for masked input (rows past
    `masked_m`), `[M_pad]` for contiguous input (rows that hold no token). A check for
    conformance and tests, not the hot path."""
    if isinstance(inp, MaskedInput):
        rows = torch.arange(inp.hidden.shape[1], device=inp.hidden.device)
        return rows[None, :] >= inp.masked_m[:, None]
    return ~inp.live_rows()


def with_dirty_padding(inp: MaskedInput | ContiguousInput) -> MaskedInput | ContiguousInput:
    """A copy of a grouped input whose padding rows hold NaN (the largest value, for integer
    dtypes), scales too: what a dispatcher that leaves them as they were (DeepEP's low-latency
    receive buffer) may hand the experts. The input itself, a dispatcher's buffer, is left alone."""
    import dataclasses

    pad = padding_rows(inp)

    def dirty(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = t.clone()
        if t.element_size() == 1 and t.dtype.is_floating_point:  # fp8: NaN's bits (0x7f in e4m3fn and e5m2)
            out.view(torch.uint8)[pad] = 0x7F
        else:
            out[pad] = float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max
        return out

    return dataclasses.replace(inp, hidden=dirty(inp.hidden), scales=dirty(inp.scales))
