"""Expert parallelism across two processes: the HCCL dispatcher's orchestration with
npu_moe_distribute_dispatch/combine emulated over a gloo group."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ep_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(*args: str) -> list[str]:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
    return outs


def test_hccl_refuses_an_ep_rank_that_is_not_the_process_rank():
    # each rank would load the other's experts and receive tokens meant for them: wrong output
    outs = _run_two_ranks("bf16", "swapped")
    for rank, out in enumerate(outs):
        why = f"this process is rank {rank} of the group, MoEConfig.ep_rank is {1 - rank}"
        assert f"rank {rank} ConfigError: {why}" in out, out  # the layer: the caller's config, before selection
        assert f"npu.hccl: declined: {why}" in out, out


@pytest.mark.parametrize("quant", ["bf16", "w8a8_int8"])
def test_hccl_dispatch_two_ranks(quant):
    for rank, out in enumerate(_run_two_ranks(quant)):
        assert f"rank {rank} {quant} npu.hccl -> npu.gmm [npu_ll_flat" in out, out
