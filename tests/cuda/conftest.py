"""CUDA backend tests. Without a GPU the Triton kernels run under the interpreter
(TRITON_INTERPRET=1 must be set before triton decorates the kernels, so it is set here)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
