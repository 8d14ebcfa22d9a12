"""Test-only plugin: the reference experts consuming CONTIGUOUS rows with segments aligned to 8
(like DeepGEMM's contiguous layout wants 128), so the EP dispatcher's alignment is exercised."""

from __future__ import annotations

from collections.abc import Sequence

from moehal.capability import accept
from moehal.formats import ActivationFormat, Layout
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, BuildRequest, Experts
from moehal.reference.experts import ReferenceExperts, dispatch_quant_formats


class AlignedExperts(ReferenceExperts):
    name = "experts_aligned8"

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        fmts = dispatch_quant_formats(req.quant, Layout.CONTIGUOUS, req.config.dtype)
        return [ActivationFormat(f.layout, f.dtype, f.scales, row_alignment=8) for f in fmts]


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(name="aligned", version="0", description="test-only", available=lambda hw: accept("test"))


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    return [AlignedExperts()]
