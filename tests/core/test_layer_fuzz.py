"""Layer-level differential fuzz on every backend that runs on a CPU (the machinery, and what
is drawn: tests/layer_fuzz.py; the `cuda` backend on a GPU: tests/cuda/test_gpu_fuzz.py).

Each test runs CI's count of examples, derandomized, so a run is repeatable. To draw more than
CI does, as the GPU fuzz's knobs do: `MOEHAL_FUZZ_SEED=N` draws another repeatable series
(hypothesis's `seed`), and `MOEHAL_FUZZ_SCALE=X` multiplies every test's count, e.g.
`MOEHAL_FUZZ_SEED=54 MOEHAL_FUZZ_SCALE=10 TRITON_INTERPRET=1 pytest tests/core/test_layer_fuzz.py -k nvfp4`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, seed, settings
from layer_fuzz import FUZZ, INTERPRET, check, layer_cases

SEED = os.environ.get("MOEHAL_FUZZ_SEED")
SCALE = float(os.environ.get("MOEHAL_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> Callable[[Any], Any]:
    """The fuzz's settings for a test of `examples` (CI's count), seeded and scaled as above."""

    def apply(test: Any) -> Any:
        if SEED is not None:  # (an explicit seed outranks derandomize: CI's series stays as it was)
            test = seed(int(SEED))(test)
        return settings(FUZZ, max_examples=max(1, round(examples * SCALE)), derandomize=SEED is None)(test)

    return apply


@given(layer_cases("reference"))
@fuzz(150)
def test_reference_backend(case):
    check(case)


@given(layer_cases("rocm"))
@fuzz(45)
def test_rocm_backend(case):
    """Its Triton experts under the interpreter (TRITON_INTERPRET=1), else its slow fallback."""
    check(case)


@given(layer_cases("npu"))
@fuzz(100)
def test_npu_backend_emulated(case):
    check(case)


@pytest.mark.skipif(not INTERPRET or torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 on a CPU machine")
@given(layer_cases("cudacpu"))
@fuzz(16)
def test_cuda_pieces_on_the_cpu(case):
    check(case)


@pytest.mark.skipif(not INTERPRET or torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 on a CPU machine")
@given(layer_cases("cudacpu", ("nvfp4",)))
@fuzz(10)
def test_nvfp4_experts_for_hopper_on_the_cpu(case):
    """`cuda.deepgemm_nvfp4_dequant`'s runner over drawn layers (layouts, EP ranks, biases, the
    w13 bias too since session 50, batches), its Triton GEMMs and glue interpreted, at the
    scheme's tolerance. That tolerance
    (0.1) let session 48's path pass here too, 2.5-3% from the oracle: the experts' own test
    (tests/cuda/test_deepgemm_glue.py, 4e-3) is the one that tells the two apart."""
    check(case)
