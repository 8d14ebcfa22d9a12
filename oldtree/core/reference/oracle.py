"""The oracle pipeline on any device: reference dispatcher and reference experts.

`MoELayer(..., backend="reference")` forces the reference *experts* only: the dispatcher still
comes from selection, so that a vendor's dispatcher can be checked in front of reference
experts (the EP suite and conformance do that). As an oracle on a GPU that is a trap:
`cuda.permute` outranks `reference.local` there and quantizes fp8 activations with its own
kernel, so the "reference" checked the vendor's quantization against itself (the fp8 EP cases
on 2 x H200, session 17). `reference_layer` cannot pick anything but the reference pipeline.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from moehal.config import MoEConfig
from moehal.plugins import Registry, discover
from moehal.quant import QuantScheme

if TYPE_CHECKING:
    from moehal.layer import MoELayer

ORACLE_DISPATCHER = "reference.local"


def reference_layer(
    config: MoEConfig,
    quant: QuantScheme | str,
    device: torch.device | str,
    layout: str | None = None,
    registry: Registry | None = None,
    **kwargs: Any,
) -> MoELayer:
    """A `MoELayer` of `reference.local -> reference.experts` on `device` (`layout` as
    `MoELayer` takes it; `kwargs` go to `MoELayer`). Returns the layer, weights not loaded."""
    from moehal.layer import MoELayer  # the layer imports the plugins that import this package

    reg = copy.copy(registry if registry is not None else discover())
    reg.dispatchers = [d for d in reg.dispatchers if d.qualname == ORACLE_DISPATCHER]
    if not reg.dispatchers:
        raise ValueError(
            f"{ORACLE_DISPATCHER} is not registered in this registry: register the reference plugin "
            "(moehal.reference.plugin) or pass registry=None for the installed plugins"
        )
    return MoELayer(config, quant, backend="reference", device=device, layout=layout, registry=reg, **kwargs)
