"""Test-only plugin: the reference experts writing their result into a fresh buffer "cleared" by
multiplying it by zero. That is right for whatever finite values the allocator left there and
wrong for NaN or Inf, which `torch.empty` can hand back too: the EP ranks' poisoning
(`moehal.poison`) makes it fail every run."""

from __future__ import annotations

from collections.abc import Sequence

from moehal.capability import accept
from moehal.formats import StandardOutput
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, BuildRequest, Experts
from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner


class _UnclearedRunner(ReferenceExpertsRunner):
    def apply(self, inp):
        ref = super().apply(inp)
        return StandardOutput(ref.hidden.new_empty(ref.hidden.shape).mul_(0).add_(ref.hidden))


class UnclearedExperts(ReferenceExperts):
    name = "experts_uncleared"

    def input_formats(self, req: BuildRequest):
        return [f for f in super().input_formats(req) if f.layout_name == "standard"]

    def build(self, req: BuildRequest, fmt):
        return _UnclearedRunner(req, fmt)


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(name="uncleared", version="0", description="test-only", available=lambda hw: accept("test"))


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    return [UnclearedExperts()]
