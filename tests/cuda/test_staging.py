"""`moehal.kernels.staging.Stager`: a replayed graph's inputs copied in with one kernel. On CPU
the kernel runs in the Triton interpreter (its logic, and the torch fallback); on a GPU the test
also checks that later calls go through the compiled kernel's own launcher and stay exact."""

from __future__ import annotations

import pytest
import torch
from moehal.kernels.staging import Stager

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(t: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 72, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 64, (t, 4), generator=g, dtype=torch.int64)  # 2 words each: sizes differ
    w = torch.rand(t, 4, generator=g)
    return tuple(a.to(DEV) for a in (x, ids, w))


@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_stager_copies_every_input_exactly(tokens: int) -> None:
    dests = tuple(torch.zeros_like(a) for a in _inputs(tokens, 0))
    stage = Stager(dests)
    for seed in range(3):  # first call compiles (JIT launch); later ones may launch directly
        src = _inputs(tokens, seed)
        stage(src)
        for d, s in zip(dests, src):
            assert torch.equal(d, s)
    if DEV == "cuda":
        assert stage.direct_launches == 2, "later calls should use the compiled kernel's launcher"


def test_stager_falls_back_for_sources_it_cannot_view_as_aligned_words() -> None:
    x, ids, w = _inputs(6, 1)
    dests = (torch.zeros_like(x), torch.zeros_like(ids), torch.zeros_like(w))
    stage = Stager(dests)
    stage((x, ids, w))
    wide = torch.randn(6, 8, device=DEV)
    strided = wide[:, ::2]  # not contiguous
    shifted = torch.rand(6 * 4 + 1, device=DEV)[1:].view(6, 4)  # 4 bytes past a 16-byte boundary
    assert not strided.is_contiguous() and shifted.data_ptr() % 16
    for w_new in (strided, shifted):
        stage((x, ids, w_new))
        assert torch.equal(dests[2], w_new)


def test_stager_of_odd_sized_inputs_copies_with_torch() -> None:
    a = torch.arange(3, dtype=torch.int8, device=DEV)  # 3 bytes: not whole int32 words
    dest = torch.zeros_like(a)
    Stager((dest,))((a,))
    assert torch.equal(dest, a)
