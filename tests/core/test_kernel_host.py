"""`moehal.kernels.host`: the wrappers' host arithmetic must equal Triton's own helpers (they
replace `triton.cdiv` / `triton.next_power_of_2` in launch code), and the interpreter switch must
read TRITON_INTERPRET as Triton does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from moehal.kernels.host import cdiv, interpreting, next_power_of_2

triton = pytest.importorskip("triton")


@given(st.integers(min_value=-(2**40), max_value=2**40), st.integers(min_value=1, max_value=2**20))
def test_cdiv_matches_triton(a: int, b: int) -> None:
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(st.integers(min_value=0, max_value=2**40))
def test_next_power_of_2_matches_triton(n: int) -> None:
    assert next_power_of_2(n) == triton.next_power_of_2(n)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("", False), ("2", False)],
)
def test_interpreting_reads_the_variable_as_triton_does(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is expected
    knobs = pytest.importorskip("triton.knobs")
    if hasattr(knobs, "getenv_bool"):  # Triton's own parser, where this release exposes it
        assert knobs.getenv_bool("TRITON_INTERPRET", False) is expected


def test_tile_config_reads_both_table_spellings() -> None:
    from moehal.kernels.tiles import TileConfig

    ours = TileConfig(32, 64, 128, 8, 4, 5)
    assert TileConfig.from_dict(ours.as_dict()) == ours
    vllm = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8, "num_warps": 4}
    assert TileConfig.from_dict(vllm) == TileConfig(32, 64, 128, 8, 4, 2)  # vLLM's default: 2 stages
    assert TileConfig.from_dict({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}).num_stages == 3
