"""Division by a constant as IEEE 754 defines it, on every device.

On CUDA, torch divides a tensor by a Python number as a multiply by the number's reciprocal
(ATen's `div_true_kernel_cuda`: "may lose one bit of precision"); on the CPU it divides. A
quantization scale one ulp off moves every value that lies exactly on a rounding tie of the
quantized grid, and with bf16 inputs such ties are common: their few significant bits make
`x / scale` exact whenever the scale's significand is short. Session 48 found the oracle on an
H200 3.5e-2 (rel_l2) away from the same oracle on a CPU for a one-token fp8_block layer, past
fp8's tolerance, because of this one ulp. Dividing by a tensor on the device divides exactly
everywhere.
"""

from __future__ import annotations

import torch


def div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """`x / divisor`, correctly rounded on every device (`x` float32 or wider)."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)
