"""The layer-level differential fuzz (tests/layer_fuzz.py) on a GPU, for the `cuda` backend:
`MoELayer` built from drawn configurations at the sizes where its kernels change (1-256
experts, top-k up to 10, hidden and intermediate sizes up to 2048, 0 to 4096 tokens at the
edges of its bands and tiles), every pipeline it accepts in turn, eager calls or graph replays,
each output compared with the reference oracle on the GPU (and, for small layers and batches,
with the float64 loop). Examples: `MOEHAL_GPU_FUZZ_EXAMPLES` (default 40); hypothesis runs them
derandomized, so a run is repeatable. `MOEHAL_GPU_FUZZ_SHRINK=0` reports a failing example as
drawn, without shrinking it (on a time-boxed device call, shrinking may outlast the box).
`MOEHAL_GPU_FUZZ_SEED=N` draws another repeatable series (hypothesis's `seed`), for runs
that add examples to the default one instead of repeating its first ones."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
from hypothesis import Phase, given, seed, settings
from layer_fuzz import FUZZ, check, layer_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"),
]
EXAMPLES = int(os.environ.get("MOEHAL_GPU_FUZZ_EXAMPLES", "40"))
SEED = os.environ.get("MOEHAL_GPU_FUZZ_SEED")
PHASES = [p for p in Phase if p is not Phase.shrink or os.environ.get("MOEHAL_GPU_FUZZ_SHRINK", "1") != "0"]


@given(layer_cases("cuda"))
@settings(FUZZ, max_examples=EXAMPLES, phases=PHASES, derandomize=SEED is None)
@seed(int(SEED or 0))
def test_cuda_backend_on_the_gpu(case):
    from moehal.kernels.triton_permute import release_workspaces

    # each example's layers allocate worst-case masked buffers for their shape (gigabytes at
    # 256 experts and 4096 tokens): give the last example's back first
    release_workspaces()
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    name = check(case)
    keys = ("quant", "num_experts", "top_k", "hidden_size", "intermediate_size", "tokens", "cuda_graph_tokens")
    print(f"passed {time.perf_counter() - t0:6.1f} s {name}", *(f"{k}={case[k]}" for k in keys))  # the log of a run
