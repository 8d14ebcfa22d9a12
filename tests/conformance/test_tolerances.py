"""The conformance checker's own arithmetic: the tolerance table, `compare`, and the routing
cases' correction bias. A checker that loosens a tolerance, accepts either metric, passes
anything against an all-zero reference or never sets a correction bias still passes a
correct backend; these tests catch it."""

from __future__ import annotations

import pytest
import torch
from moehal import MoEConfig
from moehal.quant import ALL_SCHEMES, QuantKind, QuantScheme
from moehal.routing import RoutingConfig
from moehal_conformance.cases import BASE, Case
from moehal_conformance.runner import make_problem
from moehal_conformance.tolerances import compare, tolerance_for

_BF16 = QuantScheme.parse("bf16")

# docs/conformance.md, section "Tolerances": (rel_l2, rel_max). A change to either side is a
# reviewed change with its source, made in the table, in conformance/tolerances.py and here.
_UNQUANTIZED = {
    torch.bfloat16: (1.6e-2, 4e-2),
    torch.float16: (4e-3, 1e-2),
    torch.float32: (2e-3, 5e-3),
}
_QUANTIZED = {
    QuantKind.FP8_BLOCK: (0.035, 0.25),
    QuantKind.FP8_TENSOR: (0.035, 0.25),
    QuantKind.W8A8_INT8: (0.065, 0.3),
    QuantKind.NVFP4: (0.1, 0.5),
}


@pytest.mark.parametrize("dtype", list(_UNQUANTIZED), ids=str)
def test_unquantized_tolerances_are_the_documented_ones(dtype):
    tol = tolerance_for(_BF16, dtype)
    assert (tol.rel_l2, tol.rel_max) == _UNQUANTIZED[dtype], tol


@pytest.mark.parametrize("quant", [q for q in ALL_SCHEMES if q.is_quantized], ids=lambda q: q.name)
def test_quantized_tolerances_are_the_documented_ones_whatever_the_dtype(quant):
    for dtype in _UNQUANTIZED:
        tol = tolerance_for(quant, dtype)
        assert (tol.rel_l2, tol.rel_max) == _QUANTIZED[quant.kind], (quant.name, dtype, tol)


def test_every_quant_kind_has_a_documented_tolerance():
    assert set(_QUANTIZED) | {QuantKind.BF16} == set(QuantKind)


def _ref():
    return torch.randn(256, 128, generator=torch.Generator().manual_seed(0))


def test_one_wrong_element_fails_on_rel_max_though_rel_l2_passes():
    """Both metrics must hold: a single element off by 30% of the output's largest value is a
    bug (one row of one expert wrong) even though it barely moves the L2 norm."""
    tol = tolerance_for(_BF16, torch.bfloat16)
    ref = _ref()
    out = ref.clone()
    out[3, 5] += 0.3 * ref.abs().max()
    c = compare(out, ref, tol)
    assert c.rel_l2 <= tol.rel_l2 and c.rel_max > tol.rel_max, c.detail
    assert not c.ok, c.detail


def test_a_small_error_everywhere_fails_on_rel_l2_though_rel_max_passes():
    tol = tolerance_for(_BF16, torch.bfloat16)
    ref = _ref()
    out = ref + 0.05 * torch.where(ref >= 0, 1.0, -1.0)  # every element 5% of the output's rms off
    c = compare(out, ref, tol)
    assert c.rel_l2 > tol.rel_l2 and c.rel_max <= tol.rel_max, c.detail
    assert not c.ok, c.detail


def test_an_output_within_both_metrics_passes():
    tol = tolerance_for(_BF16, torch.bfloat16)
    ref = _ref()
    assert compare(ref.bfloat16(), ref, tol).ok  # bf16 rounding alone: rel error <= 2**-9


def test_an_all_zero_reference_passes_only_an_all_zero_output():
    """rel_l2 and rel_max divide by the reference, so an all-zero reference (every slot padded,
    or every token sent to other ranks) takes an exact zero output and nothing else."""
    tol = tolerance_for(_BF16, torch.bfloat16)
    zero = torch.zeros(4, 16)
    assert compare(torch.zeros(4, 16), zero, tol).ok
    bad = torch.zeros(4, 16)
    bad[2, 7] = 1e-3
    for out in (torch.ones(4, 16), bad):
        c = compare(out, zero, tol)
        assert not c.ok, c.detail


def test_deepseek_routing_cases_get_a_nonzero_correction_bias():
    """The routing family's DeepSeek-V3 config (conformance/cases.py) loads a correction bias;
    a zero (or constant) bias would leave the bias's effect on the selection unchecked."""
    routing = RoutingConfig("deepseek_v3", n_group=4, topk_group=2, has_correction_bias=True)
    cfg = MoEConfig(**BASE).with_(routing=routing, top_k=4)  # type: ignore[arg-type]
    case = Case("routing/bf16/deepseek_v3_fp32_logits", "routing", "logits", cfg, _BF16)
    prob = make_problem(case)
    bias = prob.weights.correction_bias
    assert bias is not None and bias.shape == (cfg.num_experts,)
    assert bias.abs().max() > 0 and bias.unique().numel() > 1, bias
    assert prob.logits is not None and prob.logits.shape == (case.tokens, cfg.num_experts)
