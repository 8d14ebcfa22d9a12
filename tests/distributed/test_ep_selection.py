"""Single-process checks of EP selection: who accepts ep_size > 1, and why others decline."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from moehal import ConfigError, MoEConfig, MoELayer
from moehal.ep_dispatcher import TorchDistributedDispatcher
from moehal.formats import ActivationFormat, Layout, ScaleKind
from moehal.hardware import detect
from moehal.interfaces import BuildRequest
from moehal.quant import BF16
from moehal.reference.dispatcher import ReferenceDispatcher

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64, ep_rank=0, ep_size=2)


def _req(cfg=CFG, group=None):
    return BuildRequest(cfg, BF16, detect("cpu"), process_group=group)


def test_ep_dispatcher_declines_without_ep():
    d = TorchDistributedDispatcher().check_parallel(_req(CFG.with_(ep_size=1)))
    assert not d.ok and "ep_size is 1" in d.reason


def test_ep_dispatcher_declines_without_group():
    d = TorchDistributedDispatcher().check_parallel(_req())
    assert not d.ok and "process_group=group" in d.reason


def test_ep_dispatcher_declines_when_distributed_is_not_initialized():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    d = TorchDistributedDispatcher().check_parallel(_req(group=object()))
    assert not d.ok and "not initialized" in d.reason


def test_local_dispatcher_keeps_single_process_partial_sums_but_declines_real_ep():
    assert ReferenceDispatcher().check_parallel(_req()).ok
    d = ReferenceDispatcher().check_parallel(_req(group=object()))
    assert not d.ok and "partial sum" in d.reason


@pytest.mark.parametrize(
    "fmt,ok",
    [
        (ActivationFormat(Layout.CONTIGUOUS, torch.bfloat16, row_alignment=64), True),
        (ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128), True),
        (ActivationFormat(Layout.STANDARD, torch.int8, ScaleKind.PER_TOKEN), True),
        (ActivationFormat(Layout.MASKED, torch.float16), False),
        (ActivationFormat(Layout.MASKED, torch.int8, ScaleKind.GROUP_128), False),
        (ActivationFormat("vendor_flat", torch.bfloat16), False),
    ],
)
def test_can_produce(fmt, ok):
    assert TorchDistributedDispatcher().can_produce(fmt, _req()).ok is ok


def test_group_size_must_match_ep_size(world_of_one):
    d = TorchDistributedDispatcher().check_parallel(_req(group=world_of_one))
    assert not d.ok and "1 ranks" in d.reason and "ep_size is 2" in d.reason
    # the layer says so itself, before selection: a NoBackendError of every backend's reasons hid it
    with pytest.raises(ConfigError, match="the process group has 1 ranks, MoEConfig.ep_size is 2"):
        MoELayer(CFG, "bf16", device="cpu", process_group=world_of_one)


def test_ep_oracle_is_the_reference_pipeline_whatever_outranks_it(outranked_reference_registry):
    """The oracle must not pick up a vendor dispatcher that outranks `reference.local` (session
    17: on 2xH200 the fp8 EP cases were checked against `cuda.permute`'s quantization and
    failed). `backend="reference"` forces the experts only (a vendor's dispatcher may be checked
    in front of reference experts); `oracle_layer` and `reference_layer` force the pipeline."""
    import moehal
    from moehal import distributed_check as dc
    from moehal.reference.oracle import reference_layer

    reg = outranked_reference_registry
    case = next(c for c in dc.ep_cases(2) if c.quant == "fp8_block")
    quant = moehal.QuantScheme.parse(case.quant)
    plain = MoELayer(case.config(), quant, backend="reference", device="cpu", layout=case.layout, registry=reg)
    assert plain.plan.pipeline.name.startswith("vendorlike.fast_local")  # the hazard: experts only
    oracle = dc.oracle_layer(case, quant, torch.device("cpu"), reg)
    assert oracle.plan.pipeline.name.startswith("reference.local -> reference.experts")
    ref = reference_layer(case.config(), quant, "cpu", layout=case.layout, registry=reg)
    assert ref.plan.pipeline.name.startswith("reference.local -> reference.experts")
    assert "vendorlike.fast_local" in {d.qualname for d in reg.dispatchers}, "the caller's registry is left as it was"


def test_ranks_agreement_check_needs_an_initialized_group():
    """A vendor dispatcher could accept a group without torch.distributed initialized; the
    build-time agreement check then says so as a ConfigError, not a bare RuntimeError."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from moehal import ConfigError
    from moehal.ep_dispatcher import check_ranks_agree

    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        check_ranks_agree(_req(group=object()), {"dispatcher": "x", "dispatch format": "y"})
