# ruff: noqa: ANN001, ANN201  (Triton JIT functions: arguments are untyped by design)
"""NVFP4 activation quantization on Triton tiles, shared by the glue between the grouped GEMMs
(`moehal_cuda.triton_glue`) and the token-major decode kernels
(`moehal.kernels.triton_token_moe`), whose GEMM1 writes GEMM2's input quantized (a launch
saved per decode step).

Only the activations are quantized here: the weights are NVFP4 codes unpacked at load
(`moehal_cuda.nvfp4_dequant`), and the global scales are applied in the GEMMs' fp32 epilogues.
"""

import triton
import triton.language as tl
from moehal.kernels.host import kernel_modules_interpreted
from moehal.kernels.triton_permute import round_to_e4m3_grid

kernel_modules_interpreted()  # the mode triton.jit decorates this module's kernels in: checked (host.py)


@triton.jit
def nvfp4_qdq(v, gs, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Quantize float32 `[BLOCK_R, BLOCK_C]` as NVFP4 with global scale `gs` (e2m1 values, one
    e4m3 scale per 16 elements), exactly as `moehal.quant.nvfp4.quantize`, and return the codes
    times their block scales (`moehal.quant.nvfp4.block_values`): `qdq` times `gs`, exact in
    bf16. The GEMM that reads them divides by the global scales in its fp32 epilogue; divided
    here, each value would be rounded to bf16 on its own, and those roundings, shared by every
    value of one code, moved NVFP4 layers by up to 11% from the reference (session 49)."""
    b = tl.reshape(v, (BLOCK_R, BLOCK_C // 16, 16))
    amax = tl.max(tl.abs(b), axis=2)
    # div_rn: IEEE division, as the reference divides (Triton's `/` is approximate on GPUs)
    sf = tl.minimum(tl.div_rn(amax, 6.0) * gs, 448.0)
    if EXACT_ROUND:
        sf = round_to_e4m3_grid(sf)
    else:
        sf = sf.to(tl.float8e4nv).to(tl.float32)
    inv = tl.where(sf > 0, tl.div_rn(gs, tl.maximum(sf, 1e-30)), 0.0)
    x = b * inv[:, :, None]
    mag = tl.minimum(tl.abs(x), 6.0)
    q = tl.where(mag > 0.25, 0.5, 0.0)
    q = tl.where(mag >= 0.75, 1.0, q)
    q = tl.where(mag > 1.25, 1.5, q)
    q = tl.where(mag >= 1.75, 2.0, q)
    q = tl.where(mag > 2.5, 3.0, q)
    q = tl.where(mag >= 3.5, 4.0, q)
    q = tl.where(mag > 5.0, 6.0, q)
    q = tl.where(x < 0, -q, q)
    return tl.reshape(q * sf[:, :, None], (BLOCK_R, BLOCK_C))
