"""AcmeExperts: a small, exact experts kernel in plain torch.

Dense: every local expert runs on every token and the router weight (zero for experts a
token did not pick) selects the result. That costs E_local / top_k times the routed FLOPs,
so it is an example, not a fast kernel; in exchange it has no data-dependent shapes and no
host sync, so it is safe inside CUDA graphs, and it is bitwise deterministic.

Rounding follows moehal's reference (`moehal.reference.math.expert_mlp`): GEMM1 output and
the activation output are stored in the layer dtype, GEMM2 output is rounded to the layer
dtype, then weighted and summed over k in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from moehal import (
    Activation,
    ActivationFormat,
    BuildRequest,
    Decision,
    Experts,
    ExpertWeights,
    Layout,
    QuantScheme,
    accept,
    decline,
)
from moehal.formats import StandardInput, StandardOutput
from moehal.interfaces import ExpertsRunner


class AcmeExpertsRunner(ExpertsRunner):
    """Bound to one layer: holds its weights, runs the experts on a STANDARD input."""

    def __init__(self, req: BuildRequest, fmt: ActivationFormat) -> None:
        self.fmt = fmt
        self.num_local = req.config.num_local_experts
        self.dtype = req.config.dtype
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def load(self, weights: Any) -> None:
        # Canonical layout (no WeightProcessor): w13 [E, 2I, H] = [gate; up], w2 [E, H, I].
        assert isinstance(weights, ExpertWeights)
        self.w13, self.w2 = weights.w13, weights.w2

    def apply(self, inp: Any) -> StandardOutput:
        assert self.w13 is not None and self.w2 is not None, "weights not loaded"
        assert isinstance(inp, StandardInput)
        x = inp.hidden  # [T, H] layer dtype
        ids = inp.topk_ids.long()  # [T, K] local expert ids, -1: expert not on this rank
        # coef[t, e] = router weight of expert e for token t (0 if not picked). Slots with
        # id -1 go to an extra column that is dropped.
        coef = torch.zeros(x.shape[0], self.num_local + 1, dtype=torch.float32, device=x.device)
        coef.scatter_add_(1, torch.where(ids < 0, self.num_local, ids), inp.topk_weights.float())
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.num_local):
            gate, up = (x @ self.w13[e].t()).float().chunk(2, dim=-1)  # GEMM1 output in the layer dtype
            a = (torch.nn.functional.silu(gate) * up).to(self.dtype)  # [T, I]
            y = (a @ self.w2[e].t()).float()  # [T, H]
            out.addcmul_(coef[:, e : e + 1], y)
        return StandardOutput(out.to(self.dtype))


class AcmeExperts(Experts):
    """What acme supports, declared as class attributes plus named predicates."""

    name = "experts"  # qualified name: acme.experts
    # Above moehal's reference (0) and below hardware backends (>= 10): installing this
    # example never displaces a vendor kernel.
    priority = 5
    description = "dense pure-torch experts: gated SiLU, unquantized, standard layout"
    devices = frozenset({"cpu", "cuda"})
    quant_schemes = frozenset({QuantScheme.parse("bf16")})  # unquantized (bf16, fp16 or fp32 layers)
    activations = frozenset({Activation.SILU})
    supports_non_gated = False
    supports_bias = False
    supports_router_weight_on_input = True  # the dispatcher applies it; experts see weights of one
    graph_capturable = True  # static shapes, no host sync
    deterministic = True

    def check_shape(self, req: BuildRequest) -> Decision:
        # A real kernel declares its tiling limits here, with a sentence a person can act on.
        if req.config.num_local_experts > 256:
            return decline(
                f"the dense acme kernel is for small expert counts; {req.config.num_local_experts} local "
                "experts would run 256+ full GEMMs per token batch: use a grouped-GEMM backend",
                "shape",
            )
        return accept(predicate="shape")

    def input_formats(self, req: BuildRequest) -> Sequence[ActivationFormat]:
        return [ActivationFormat(Layout.STANDARD, req.config.dtype)]

    def build(self, req: BuildRequest, fmt: ActivationFormat) -> ExpertsRunner:
        return AcmeExpertsRunner(req, fmt)
