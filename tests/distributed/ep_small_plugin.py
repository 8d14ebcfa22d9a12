"""Test-only experts plugin for EP: reference experts whose main format is CONTIGUOUS in the
layer's quant scheme (as `cuda.deepgemm`'s) and whose small-batch format is STANDARD
unquantized (as `cuda.deepgemm`'s decode and prefill bands). Under EP each rank picks the
small format from its own token count (session 44's audit found fp8 layers aborting in gloo)."""

from __future__ import annotations

from collections.abc import Sequence

from moehal.capability import accept
from moehal.formats import ActivationFormat, Layout, SmallBatchFormat, StandardInput
from moehal.hookspecs import hookimpl
from moehal.interfaces import BackendInfo, BuildRequest, Experts, ExpertsRunner
from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner, dispatch_quant_formats

SMALL_MAX = 4


class _TwoFormatRunner(ExpertsRunner):
    """Takes both formats, as `DeepGemmExpertsRunner` does."""

    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        self.fmt = fmt
        self._main = ReferenceExpertsRunner(req, fmt)
        self._small = ReferenceExpertsRunner(req, ActivationFormat(Layout.STANDARD, req.config.dtype))

    def load(self, weights):
        self._main.load(weights)
        self._small.load(weights)

    def apply(self, inp):
        return self._small.apply(inp) if isinstance(inp, StandardInput) else self._main.apply(inp)


class SmallFormatExperts(ReferenceExperts):
    name = "experts_small_format"
    priority = 1

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        return dispatch_quant_formats(req.quant, Layout.CONTIGUOUS, req.config.dtype)[:1]

    def small_batch_format(self, req: BuildRequest) -> SmallBatchFormat:
        fmt = ActivationFormat(Layout.STANDARD, req.config.dtype)
        return SmallBatchFormat(fmt, SMALL_MAX, "test: token-major decode")

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return _TwoFormatRunner(req, fmt)


@hookimpl
def moehal_backend_info() -> BackendInfo:
    return BackendInfo(name="smallfmt", version="0", description="test-only", available=lambda hw: accept("test"))


@hookimpl
def moehal_experts() -> Sequence[Experts]:
    return [SmallFormatExperts()]
