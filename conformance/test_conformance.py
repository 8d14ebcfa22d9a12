"""The conformance tests (collected only with --moehal-backend; see pytest_plugin.py)."""

from __future__ import annotations

import pytest
from moehal_conformance.runner import DECLINED, NOT_RUN, PASS, CaseRunner


def test_case(moehal_case, moehal_suite):
    runner = CaseRunner(moehal_suite.registry, moehal_suite.device, moehal_suite.poison)
    result = runner.run(moehal_case)
    moehal_suite.results.append(result)
    moehal_suite.poisoned_allocations += runner.poisoned
    if result.status in (DECLINED, NOT_RUN):
        pytest.skip(f"{result.status}: {result.detail}")
    assert result.status == PASS, f"{moehal_case.id}: {result.detail}"


def test_backend_claims_something(moehal_suite):
    """A backend that claims nothing gets a report of declines, not a green run."""
    # (features too: a fused kernel with a minimum size is claimed at features/wide_512 alone)
    families = ("matrix", "features", "shapes")
    claimed = [c for c in moehal_suite.cases() if c.family in families and c.pipeline is not None]
    assert claimed, f"backend {moehal_suite.backend!r} accepts no configuration on {moehal_suite.device}"
