"""The SGLang benchmark peer declines honestly where it cannot run (the GPU run uses it)."""

from __future__ import annotations

import sys

import moehal
import pytest
import torch
from moehal.integrations import sglang

CFG = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)


def _weights():
    return torch.randn(4, 64, 64), torch.randn(4, 64, 32)


def test_declines_off_cuda():
    with pytest.raises(moehal.NotSupportedError, match="CUDA devices only"):
        sglang.peer_callable(CFG, *_weights(), "cpu")


def test_declines_other_activations():
    with pytest.raises(moehal.NotSupportedError, match="SiLU-and-mul"):
        sglang.peer_callable(CFG.with_(activation="gelu"), *_weights(), "cuda")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(routed_scaling_factor=2.5), "routed_scaling_factor"),
        (dict(top_k=1, apply_router_weight_on_input=True), "apply_router_weight_on_input"),
        (dict(ep_size=2), "ep_size > 1"),
        (dict(topk_padding=True), "topk_padding"),
    ],
)
def test_declines_what_it_does_not_pass_to_sglang(change, named):
    """The peer computed another layer for these (up to 1.66 off at routed_scaling_factor 2.5,
    session 43's audit); it declines them before importing SGLang."""
    with pytest.raises(moehal.NotSupportedError, match=f"does not pass {named}"):
        sglang.peer_callable(CFG.with_(**change), *_weights(), "cuda")


def test_declines_with_the_import_error_when_sglang_is_missing(monkeypatch):
    monkeypatch.setattr(sglang, "_IMPORT_FAILURE", [])
    monkeypatch.setitem(sys.modules, sglang.ENTRY_MODULE, None)  # import raises ImportError
    with pytest.raises(moehal.NotSupportedError, match="SGLang is not importable here: ModuleNotFoundError"):
        sglang.peer_callable(CFG, *_weights(), "cuda")


def test_every_later_call_gives_the_first_import_failure(monkeypatch):
    """On the GPU machine a failed `import sglang...` (pydantic_core missing) left the package
    half-imported, and the next rows reported `KeyError: 'sglang'` instead of the cause."""
    import importlib

    monkeypatch.setattr(sglang, "_IMPORT_FAILURE", [])
    errors = iter([ModuleNotFoundError("No module named 'pydantic_core'"), KeyError("sglang")])

    def failing_import(name: str):
        raise next(errors)

    monkeypatch.setattr(importlib, "import_module", failing_import)
    for _ in range(2):
        with pytest.raises(moehal.NotSupportedError, match="ModuleNotFoundError: No module named 'pydantic_core'"):
            sglang.peer_callable(CFG, *_weights(), "cuda")


def test_bench_reports_the_peer_as_skipped_not_failed(capsys):
    from moehal.bench import main

    assert main(["--shapes", "tiny", "--tokens", "2", "--backends", "reference,sglang", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "sglang T=2: skipped" in out


def _fake_config_module(monkeypatch, result, warning: str | None = None):
    """A stand-in for SGLang's tuned-config lookup: `get_moe_configs` returns `result` and logs
    `warning` as SGLang does when it falls back to another Triton release's file."""
    import logging
    import types

    name = sglang.TUNED_CONFIG_MODULES[0]
    mod = types.ModuleType(name)
    calls = []

    def get_moe_configs(e, n, dtype, block_n=0, block_k=0):
        calls.append((e, n, dtype))
        if warning:
            logging.getLogger(name).warning(warning)
        return result

    mod.get_moe_configs = get_moe_configs
    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(sglang, "_CONFIG_SOURCES", {})
    return calls


@pytest.mark.parametrize(
    ("result", "warning", "expected"),
    [
        (None, "Using default MoE kernel config. Performance might be sub-optimal!", "default"),
        ({1: {"BLOCK_SIZE_M": 16}}, None, "tuned"),
        ({1: {}}, "Config file not found at /x. Fallback to triton version 3.4.0 and use", "tuned for Triton 3.4.0"),
    ],
)  # fmt: skip
def test_config_source_says_which_config_sglang_runs(monkeypatch, result, warning, expected):
    """Issue #4 compares against SGLang's *tuned* path; rows say where SGLang had no tuned file."""
    calls = _fake_config_module(monkeypatch, result, warning)
    assert sglang.config_source(CFG) == expected
    assert calls == [(4, 32, None)], "SGLang's own lookup: local experts, intermediate size, bf16"
    assert sglang.config_source(CFG) == expected and len(calls) == 1, "the first answer is kept per shape"


def test_config_source_is_unknown_without_sglang(monkeypatch):
    monkeypatch.setattr(sglang, "_CONFIG_SOURCES", {})
    for name in sglang.TUNED_CONFIG_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    assert sglang.config_source(CFG).startswith("unknown: ")


def test_config_source_reports_a_failing_lookup(monkeypatch):
    _fake_config_module(monkeypatch, None)

    def broken(*args):
        raise AttributeError("server args are not set")

    monkeypatch.setattr(sys.modules[sglang.TUNED_CONFIG_MODULES[0]], "get_moe_configs", broken)
    assert sglang.config_source(CFG) == "unknown: AttributeError: server args are not set"
