"""Layer-level differential fuzz on every backend that runs on a CPU (the machinery, and what
is drawn: tests/layer_fuzz.py; the `cuda` backend on a GPU: tests/cuda/test_gpu_fuzz.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from layer_fuzz import FUZZ, INTERPRET, check, layer_cases


@given(layer_cases("reference"))
@settings(FUZZ, max_examples=150)
def test_reference_backend(case):
    check(case)


@given(layer_cases("rocm"))
@settings(FUZZ, max_examples=45)
def test_rocm_backend(case):
    """Its Triton experts under the interpreter (TRITON_INTERPRET=1), else its slow fallback."""
    check(case)


@given(layer_cases("npu"))
@settings(FUZZ, max_examples=100)
def test_npu_backend_emulated(case):
    check(case)


@pytest.mark.skipif(not INTERPRET or torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 on a CPU machine")
@given(layer_cases("cudacpu"))
@settings(FUZZ, max_examples=16)
def test_cuda_pieces_on_the_cpu(case):
    check(case)
