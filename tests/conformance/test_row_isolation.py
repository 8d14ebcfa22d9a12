"""The row_isolation check: tokens whose hidden states hold NaN or Inf (a padded CUDA-graph batch's
stale rows, an overflowed activation) must change no other token's output."""

from __future__ import annotations

import torch
from moehal.formats import StandardInput, StandardOutput
from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner
from moehal_conformance.cases import BEHAVIOUR_CHECKS
from throwaway_plugin import throwaway_suite


class _BatchScaleRunner(ReferenceExpertsRunner):
    """Scales the activations by the batch's largest magnitude and back: the same numbers for
    finite inputs, but one NaN or Inf token makes every token's scale NaN or Inf."""

    def apply(self, inp):
        s = inp.hidden.float().abs().amax().clamp(min=1e-6)
        hidden = (inp.hidden.float() / s * s).to(inp.hidden.dtype)
        return super().apply(StandardInput(hidden, inp.scales, inp.topk_ids, inp.topk_weights))


class _StaleRunner(ReferenceExpertsRunner):
    """Keeps the previous call's activations (as a workspace kept across calls holds them) and
    folds them into the output weighed by zero: row-wise within a call, but after a batch with
    NaN the next one turns NaN (0 x NaN)."""

    prev: torch.Tensor | None = None

    def apply(self, inp):
        out = super().apply(inp)
        if self.prev is not None:
            out = StandardOutput(out.hidden + 0 * self.prev.float().sum().to(out.hidden.dtype))
        self.prev = inp.hidden.clone()
        return out


RUNNERS = {"rowwise": None, "batchscale": _BatchScaleRunner, "stale": _StaleRunner}


class _Experts(ReferenceExperts):
    name, priority = "rows", 40

    def __init__(self, runner: type | None) -> None:
        self.runner = runner

    def input_formats(self, req):
        return [f for f in super().input_formats(req) if f.layout_name == "standard" and not f.is_quantized]

    def build(self, req, fmt):
        return self.runner(req, fmt) if self.runner is not None else super().build(req, fmt)


def _results(name: str) -> list:
    suite = throwaway_suite(name, [_Experts(RUNNERS[name])])
    cases = [c for c in suite.cases() if c.check == "row_isolation" and c.quant.name == "bf16"]
    assert cases and all(c.pipeline is not None and c.pipeline.main.name == "rows" for c in cases)
    suite.run(cases)
    return suite.results


def test_the_check_runs_per_claimed_scheme():
    assert "row_isolation" in BEHAVIOUR_CHECKS


def test_row_wise_experts_pass():
    results = _results("rowwise")
    assert {r.status for r in results} == {"pass"}, [r.detail for r in results]
    assert all("6 of 16 tokens NaN or Inf, the others: rel_l2" in r.detail for r in results), results[0].detail


def test_a_scale_taken_over_the_batch_fails():
    results = _results("batchscale")
    assert {r.status for r in results} == {"fail"}
    for r in results:  # the decode size already shows it: 2 of 3 tokens bad, the third changed
        assert "3 tokens, 2 of them NaN or Inf: the others changed" in r.detail, r.detail


def test_nan_kept_across_calls_fails_the_next_clean_batch():
    results = _results("stale")
    assert {r.status for r in results} == {"fail"}
    for r in results:  # (its clean 16-token forward, after the dirty 3-token one, is NaN too)
        assert "a clean batch of 3 after the NaN ones differs from before them" in r.detail, r.detail
