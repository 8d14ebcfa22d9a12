"""The ROCm backend's slow fallback: the reference math in torch, on the ROCm device.

Chosen only when neither AITER nor the Triton kernels take a configuration (e.g. nvfp4 or
fp8_tensor), so that `backend='rocm'` leaves no configuration without a path. Its name says
what it is, so that every plan that picks it says so.
"""

from __future__ import annotations

from typing import ClassVar

from moehal.capability import Decision, accept
from moehal.interfaces import ALL_DEVICES, BuildRequest
from moehal.reference.experts import ReferenceExperts

SLOW_REASON = (
    "slow fallback: the pure-torch reference math (float32, a loop over experts), for configurations no "
    "ROCm kernel takes; picked only under backend='rocm' (the reference outranks it by name otherwise); "
    "`moehal explain` shows why the kernels declined"
)


class TorchFallbackExperts(ReferenceExperts):
    """Dequantize-and-loop experts: every scheme, activation, bias and layout. SLOW."""

    name = "slow_torch_fallback"
    # Priority 0, like the reference: below every kernel, and tied with the reference, whose name
    # sorts first, so that automatic selection still picks (and labels) `reference.experts`
    # on every device. With priority 1 this fallback would take every configuration that no
    # kernel takes on every CPU and GPU machine, under the name `rocm`. It is chosen when the
    # caller asks for `backend='rocm'` and no ROCm kernel accepts.
    priority = 0
    fallback = True
    description = "SLOW FALLBACK: pure-torch reference math per expert, for configurations no ROCm kernel takes"
    devices: ClassVar[frozenset[str]] = ALL_DEVICES

    def __init__(self, priority: int | None = None) -> None:
        if priority is not None:
            self.priority = priority  # type: ignore[misc]

    def supports(self, req: BuildRequest) -> Decision:
        d = super().supports(req)
        return accept(SLOW_REASON, "fallback") if d.ok else d
