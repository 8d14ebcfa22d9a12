"""The portable Triton kernels (the fused MoE with its align, quantize and sum steps), compiled,
not interpreted, for both vendors' GPUs: sm90 (H100) and gfx942 (MI300), with the tiles the
host code picks on a GPU (`triton_aot`: launches recorded, then Triton's AOT compiler; no GPU
needed). Compiling is not running: nothing here says the kernels are right or fast there."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def _fused_moe_calls(fp8_dtype: torch.dtype, is_rocm: bool) -> None:
    """The fused MoE at a decode and a prefill size, in bf16 (canonical and paired w13), fp8 1x128
    blocks, fp8 per tensor (GEMM1 quantizing its output) and int8 W8A8."""
    from moehal.kernels import triton_fused_moe as k

    e, h, i, top_k = 16, 512, 256, 4
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    weights = {
        "bf16": k.TritonMoEWeights(w13.bfloat16(), w2.bfloat16()),
        "bf16 paired": k.TritonMoEWeights(k.pair_gate_up(w13.bfloat16()), w2.bfloat16(), w13_paired=True),
        "fp8": k.TritonMoEWeights(
            w13.to(fp8_dtype), w2.to(fp8_dtype), "fp8_block",
            torch.ones(e, 2 * i // 128, h // 128), torch.ones(e, h // 128, i // 128),
        ),
        "int8": k.TritonMoEWeights(
            w13.to(torch.int8), w2.to(torch.int8), "int8", torch.ones(e, 2 * i), torch.ones(e, h)
        ),
        "fp8 per tensor": k.TritonMoEWeights(
            w13.to(fp8_dtype), w2.to(fp8_dtype), "fp8_tensor", torch.ones(e), torch.ones(e),
            a13_scale=torch.ones(1), a2_scale=torch.ones(1),
        ),
    }  # fmt: skip
    for t in (2, 512):
        x = torch.randn(t, h, generator=g).bfloat16()
        ids = torch.randint(0, e, (t, top_k), generator=g, dtype=torch.int32)
        wts = torch.rand(t, top_k, generator=g)
        for w in weights.values():
            k.fused_moe(x, ids, wts, w, is_rocm=is_rocm)
        k.fused_moe(x, ids, wts, weights["bf16"], activation="swiglu_oai", is_rocm=is_rocm)


def drive_nvidia() -> None:
    _fused_moe_calls(torch.float8_e4m3fn, is_rocm=False)
    _tma_calls()


def _tma_calls() -> None:
    """The fused MoE with its weight tiles by TMA (SM90), bf16 and fp8: the host-side check
    says no on this GPU-less machine, so it is told yes (what it answers on an H100)."""
    from dataclasses import replace

    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tiles import TileConfig

    k.tma_weights_ok = lambda *args: True
    e, h, i, top_k, t = 16, 512, 256, 4, 512
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.randint(0, e, (t, top_k), generator=g, dtype=torch.int32)
    wts = torch.rand(t, top_k, generator=g)
    tiles = (TileConfig(128, 64, 64, 8, 8, 3, True), TileConfig(128, 128, 64, 8, 4, 3, True))
    k.fused_moe(x, ids, wts, k.TritonMoEWeights(w13.bfloat16(), w2.bfloat16()), configs=tiles)
    paired = k.TritonMoEWeights(k.pair_gate_up(w13.bfloat16()), w2.bfloat16(), w13_paired=True)
    k.fused_moe(x, ids, wts, paired, configs=tiles)  # a 2*BLOCK_N-row TMA box
    fp8 = k.TritonMoEWeights(
        w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), "fp8_block",
        torch.ones(e, 2 * i // 128, h // 128), torch.ones(e, h // 128, i // 128),
    )  # fmt: skip
    k.fused_moe(x, ids, wts, fp8, configs=tuple(replace(c, block_k=128) for c in tiles))


def drive_amd() -> None:
    _fused_moe_calls(torch.float8_e4m3fnuz, is_rocm=True)  # MI300's e4m3 flavour, num_stages 2


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("drive,target", [("drive_nvidia", "sm90"), ("drive_amd", "gfx942")])
def test_portable_kernels_compile(tmp_path, drive, target):
    from triton_aot import check_in_child

    report = check_in_child(__file__, drive, [target], str(tmp_path))
    line = report.strip().splitlines()[-1].split()
    assert line[0] == target and int(line[1]) >= 6, report
    compiled = set(line[2:])
    assert {"_fused_moe_kernel", "_align_finish", "_expert_positions", "_moe_sum_kernel"} <= compiled, report
    assert {"_group_quant_fp8_kernel", "_token_quant_int8_kernel"} <= compiled, report
    if target == "sm90":  # the weight tiles by TMA, compiled to TMA copies
        assert "_fused_moe_kernel[tensordesc]" in compiled, report
