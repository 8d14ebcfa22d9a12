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


@pytest.mark.parametrize("quant", ["bf16", "w8a8_int8"])
def test_hccl_dispatch_two_ranks(quant):
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), quant],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        assert f"rank {rank} {quant} npu.hccl -> npu.gmm [npu_ll_flat" in out, out
