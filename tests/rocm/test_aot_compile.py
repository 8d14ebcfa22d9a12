"""The portable Triton kernels compiled, not interpreted, for both vendors' GPUs: sm90 (H100)
and gfx942 (MI300). Triton's AOT compiler needs no GPU, so CI catches code that the interpreter
runs but the compiler refuses (session 8 met one: a name reused in two branches). Compiling is
not running: no number here says the kernels are right or fast on that hardware.

The compiler runs in a child process: TRITON_INTERPRET, set for the whole test run, would hand
it interpreted functions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moehal.kernels import triton_fused_moe as k

TARGETS = {  # target, binary, e4m3 flavour, num_stages
    "sm90": (GPUTarget("cuda", 90, 32), "cubin", "fp8e4nv", 3),
    "gfx942": (GPUTarget("hip", "gfx942", 64), "hsaco", "fp8e4b8", 2),
}

def build(fn, types, constexprs, target, binary, **options):
    sig = dict(types)
    sig.update({name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    assert binary in triton.compile(src, target=target, options=options).asm

def gemm_types(a, b, c):
    ptrs = dict(a_ptr=a, a_scale_ptr="*fp32", b_ptr=b, b_scale_ptr="*fp32", bias_ptr="*fp32", c_ptr=c,
                topk_weights_ptr="*fp32", sorted_ids_ptr="*i32", expert_ids_ptr="*i32", num_post_ptr="*i32")
    ints = ["EM", "num_valid", "up_offset"]
    strides = ["stride_am", "stride_ak", "stride_asm", "stride_ask", "stride_be", "stride_bn", "stride_bk",
               "stride_bse", "stride_bsn", "stride_bsk", "stride_biase", "stride_biasn", "stride_cm", "stride_cn"]
    return {**ptrs, **{n: "i32" for n in ints}, "alpha": "fp32", "limit": "fp32", **{n: "i32" for n in strides}}

def gemm_consts(n, k, quant, gated, act, mul_weight, top_k, bk):
    return dict(N=n, K=k, GROUP_N=128, GROUP_K=128, BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, GROUP_M=8, TOP_K=top_k,
                MUL_ROUTED_WEIGHT=mul_weight, GATED=gated, ACT=act, QUANT=quant, HAS_BIAS=False, UPCAST=False,
                IEEE=False, FIX_BF16=False)

for name, (target, binary, fp8, stages) in TARGETS.items():
    ptrs = ("ids_ptr", "slot_pos_ptr", "counts_ptr", "sorted_ptr", "expert_ids_ptr", "num_post_ptr")
    align = {n: "*i32" for n in ptrs}
    align.update({n: "i32" for n in ("S", "L", "E", "slot_programs")})
    for bm, ep, blk in ((16, 8, 512), (64, 128, 32), (128, 256, 16)):
        build(k._align_finish, align, dict(BLOCK_M=bm, E_P=ep, BLOCK=blk), target, binary)
    opts = dict(num_warps=4, num_stages=stages)
    # bf16 GEMM1 (gate and up, SiLU) and GEMM2 (router weights), Qwen3-30B-A3B's sizes
    build(k._fused_moe_kernel, gemm_types("*bf16", "*bf16", "*bf16"),
          gemm_consts(768, 2048, k.Q_NONE, True, k.ACT_SILU, False, 8, 64), target, binary, **opts)
    build(k._fused_moe_kernel, gemm_types("*bf16", "*bf16", "*bf16"),
          gemm_consts(2048, 768, k.Q_NONE, False, k.ACT_NONE, True, 1, 64), target, binary, **opts)
    # fp8 1x128 block scale (this target's e4m3 flavour) and int8 W8A8 GEMM1
    build(k._fused_moe_kernel, gemm_types("*" + fp8, "*" + fp8, "*bf16"),
          gemm_consts(768, 2048, k.Q_FP8_BLOCK, True, k.ACT_SILU, False, 8, 128), target, binary, **opts)
    build(k._fused_moe_kernel, gemm_types("*i8", "*i8", "*bf16"),
          gemm_consts(768, 2048, k.Q_INT8, True, k.ACT_SILU, False, 8, 128), target, binary, **opts)
    build(k._moe_sum_kernel, dict(c_ptr="*bf16", ids_ptr="*i32", out_ptr="*bf16", T="i32", H="i32", stride_cm="i32",
          stride_om="i32"), dict(TOP_K=8, BLOCK_T=1, BLOCK_H=1024, FIX_BF16=False), target, binary)
    print("compiled for", name)
"""


@pytest.mark.timeout(900)
def test_portable_kernels_compile_for_sm90_and_gfx942(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: really compile
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split("\n")[:2] == ["compiled for sm90", "compiled for gfx942"], r.stdout
