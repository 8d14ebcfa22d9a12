"""Quantization schemes and their reference quantize/dequantize functions.

A scheme is data (`QuantScheme`), never a `quant_config is None` branch: the unquantized
case is the scheme `bf16` like any other. Each scheme's math lives in its own module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from moehal.errors import ConfigError


class QuantKind(str, enum.Enum):
    """The quantization family of a `QuantScheme` (its name before any ':' option)."""

    BF16 = "bf16"  # unquantized: weights and activations in MoEConfig.dtype
    FP8_BLOCK = "fp8_block"  # e4m3 weights, 128x128 weight blocks, 1x128 dynamic activation groups
    FP8_TENSOR = "fp8_tensor"  # e4m3 weights, one scale per expert; static per-tensor activation scales
    NVFP4 = "nvfp4"  # e2m1 values, e4m3 scale per 16 elements, fp32 global scale
    W8A8_INT8 = "w8a8_int8"  # int8 weights per output channel, dynamic per-token int8 activations


class ScaleFormat(str, enum.Enum):
    """How a `QuantScheme`'s scales are encoded (`fp8_block:ue8m0` asks for powers of two)."""

    FLOAT = "float"  # any fp32 scale
    UE8M0 = "ue8m0"  # scales rounded up to powers of two (DeepGEMM on SM100, DeepEP round_scale)


# The strings `QuantScheme(kind, scale_format)` takes for the enums (for type checkers; the test of
# the config types keeps them equal to the enums' values)
_QuantKindName = Literal["bf16", "fp8_block", "fp8_tensor", "nvfp4", "w8a8_int8"]
_ScaleFormatName = Literal["float", "ue8m0"]


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A quantization scheme. Build with the constants below or `QuantScheme.parse`."""

    kind: QuantKind
    scale_format: ScaleFormat = ScaleFormat.FLOAT

    if TYPE_CHECKING:
        # For type checkers only; at run time the dataclass makes __init__ from the fields. It
        # takes the enums as strings too (`QuantScheme("fp8_block", "ue8m0")`), which __post_init__
        # converts, so that the fields still read as the enums. tests/core/test_config_types.py
        # keeps it equal to the fields.
        def __init__(
            self,
            kind: QuantKind | _QuantKindName,
            scale_format: ScaleFormat | _ScaleFormatName = ScaleFormat.FLOAT,
        ) -> None: ...

    def __post_init__(self) -> None:
        for name, enum_type in (("kind", QuantKind), ("scale_format", ScaleFormat)):
            try:
                object.__setattr__(self, name, enum_type(getattr(self, name)))
            except ValueError:
                names = ", ".join(m.value for m in enum_type)
                hint = " (QuantScheme.parse reads names such as 'fp8_block:ue8m0')" if name == "kind" else ""
                raise ConfigError(
                    f"QuantScheme.{name} must be one of {names}; got {getattr(self, name)!r}{hint}"
                ) from None
        if self.scale_format is ScaleFormat.UE8M0 and self.kind is not QuantKind.FP8_BLOCK:
            raise ConfigError("UE8M0 scales are defined for fp8_block only")

    @property
    def name(self) -> str:
        if self.scale_format is ScaleFormat.UE8M0:
            return f"{self.kind.value}:ue8m0"
        return self.kind.value

    def __str__(self) -> str:
        return self.name

    @property
    def is_quantized(self) -> bool:
        return self.kind is not QuantKind.BF16

    @property
    def static_activation_scales(self) -> bool:
        """Whether activations are quantized with fixed scales that come with the weights
        (fp8_tensor's per-tensor scales, nvfp4's global scales): such weights need scales
        calibrated on real activations; the other schemes scale activations at run time."""
        return self.kind in (QuantKind.FP8_TENSOR, QuantKind.NVFP4)

    @classmethod
    def parse(cls, text: str | QuantScheme) -> QuantScheme:
        """Parse `bf16`, `fp8_block`, `fp8_block:ue8m0`, `fp8_tensor`, `nvfp4`, `w8a8_int8`."""
        if isinstance(text, QuantScheme):
            return text
        kind, colon, fmt = str(text).partition(":")
        try:
            if colon and not fmt:  # "fp8_block:" names no scale format
                raise ValueError(text)
            parsed_kind, parsed_fmt = QuantKind(kind), ScaleFormat(fmt or "float")
        except ValueError:
            known = ", ".join(s.name for s in ALL_SCHEMES)
            raise ConfigError(f"unknown quant scheme {text!r}; known: {known}") from None
        return cls(parsed_kind, parsed_fmt)


BF16 = QuantScheme(QuantKind.BF16)
FP8_BLOCK = QuantScheme(QuantKind.FP8_BLOCK)
FP8_BLOCK_UE8M0 = QuantScheme(QuantKind.FP8_BLOCK, ScaleFormat.UE8M0)
FP8_TENSOR = QuantScheme(QuantKind.FP8_TENSOR)
NVFP4 = QuantScheme(QuantKind.NVFP4)
W8A8_INT8 = QuantScheme(QuantKind.W8A8_INT8)
ALL_SCHEMES: tuple[QuantScheme, ...] = (BF16, FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_TENSOR, NVFP4, W8A8_INT8)

__all__ = [
    "ALL_SCHEMES",
    "BF16",
    "FP8_BLOCK",
    "FP8_BLOCK_UE8M0",
    "FP8_TENSOR",
    "NVFP4",
    "W8A8_INT8",
    "QuantKind",
    "QuantScheme",
    "ScaleFormat",
]
