"""One rank of the 2-process expert-parallel test (run by test_ep.py, not collected by pytest).

argv: rank world port quant. Builds the NPU backend with ep_size=world on a gloo group, in
emulated mode, so npu_moe_distribute_dispatch/combine's stand-ins move tokens between the
processes; compares this rank's output with the reference layer holding every expert.
Exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import moehal
import torch
import torch.distributed as dist
from moehal import MoEConfig, MoELayer
from moehal.weights import local_slice


def main() -> int:
    rank, world, port, quant = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(  # a rank that died leaves its peer's collectives failing, not waiting
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    full = MoEConfig(num_experts=8, top_k=3, hidden_size=128, intermediate_size=64, max_tokens=16)
    cfg = full.with_(ep_size=world, ep_rank=rank, routed_scaling_factor=1.5)
    gen = torch.Generator().manual_seed(0)  # same weights on every rank
    w13 = torch.randn(8, 128, 128, generator=gen) / 128**0.5
    w2 = torch.randn(8, 128, 64, generator=gen) / 8
    weights = moehal.quantize_weights(full, moehal.QuantScheme.parse(quant), w13, w2)
    gen = torch.Generator().manual_seed(100 + rank)  # different tokens (and counts) per rank
    t = 10 - 3 * rank
    x = torch.randn(t, 128, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(t)]).to(torch.int32)
    wts = torch.rand(t, 3, generator=gen) + 0.1

    reg = moehal.Registry(moehal.Settings(emulate=frozenset({"npu"})))
    reg.load_entry_points()
    if sys.argv[5:] == ["swapped"]:  # each rank built with another rank's ep_rank: refused before selection
        try:
            MoELayer(cfg.with_(ep_rank=world - 1 - rank), quant, backend="npu", device="cpu", registry=reg,
                     process_group=dist.group.WORLD)  # fmt: skip
        except moehal.ConfigError as exc:
            print(f"rank {rank} ConfigError: {exc}", flush=True)
        req = moehal.BuildRequest(cfg.with_(ep_rank=world - 1 - rank), moehal.QuantScheme.parse(quant),
                                  moehal.detect("cpu"), reg.settings, dist.group.WORLD)  # fmt: skip
        hccl = next(d for d in reg.dispatchers if d.qualname == "npu.hccl")  # and the dispatcher declines
        print(f"rank {rank} npu.hccl: declined: {hccl.supports(req).reason}", flush=True)
        return 0
    layer = MoELayer(cfg, quant, backend="npu", device="cpu", registry=reg, process_group=dist.group.WORLD)
    p = layer.plan.pipeline
    assert p.dispatcher.qualname == "npu.hccl", p.name
    assert p.execution_mode(layer.request) == "emulated"
    layer.load_weights(local_slice(weights, cfg))
    out = layer(x, ids, wts).float()

    ref = MoELayer(full.with_(routed_scaling_factor=1.5), quant, backend="reference", device="cpu", registry=reg)
    ref.load_weights(weights)
    r = ref(x, ids, wts).float()
    err = float((out - r).abs().max() / r.abs().max())
    tol = 0.065 if quant == "w8a8_int8" else 2e-2
    print(f"rank {rank} {quant} {p.name} rel err {err:.4g}", flush=True)
    return 0 if err < tol else 1


if __name__ == "__main__":
    code = main()
    # Both ranks are past their collectives; then leave without gloo's teardown. A rank whose
    # peer had already exited once aborted in it ("terminate called without an active
    # exception", exit -6, in CI after printing a passing result): its exit code, not its result,
    # failed the test. Nothing is left to flush or free that the test reads.
    dist.barrier()
    sys.stdout.flush()
    os._exit(code)
