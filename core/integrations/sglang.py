"""SGLang's Triton fused-MoE experts as a benchmark peer (`moehal bench --backends sglang`).

The peer is SGLang's own function, called on the same problem as moehal (canonical weights
are SGLang's layout: w13 `[E, 2I, H]` rows [gate; up], w2 `[E, H, I]`; no copy):

    sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.fused_experts(
        hidden, w1, w2, (topk_weights, topk_ids, None), MoeRunnerConfig(...))

the entry point SGLang's Triton MoE runner calls, with its shipped tuned configs chosen by
SGLang itself per (E, N, device, M). BF16 with SiLU-and-mul only: that is what the issue
compares against. It is imported only when asked for; a machine without SGLang declines with
the import error. On the offline GPU machine SGLang is made importable by
`tools/sglang_peer.py`, which says exactly what it stubs (its docstring; what ran in the records:
docs/device-runs/2026-11-22-session2/README.md, "The SGLang peer: exactly what ran").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch
from moehal.config import Activation, MoEConfig
from moehal.errors import NotSupportedError

ENTRY_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
RUNNER_CONFIG_MODULE = "sglang.srt.layers.moe.moe_runner.base"
# where SGLang looks up its shipped tuned configs (`get_moe_configs`), newer layout first
TUNED_CONFIG_MODULES = (
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",
    "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config",
)


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - not installed, or unpacked without its metadata
        pass
    try:
        return str(importlib.import_module("sglang.version").__version__)
    except Exception:  # noqa: BLE001
        return None


# The first failed import's reason, kept for the process: importing again after a failure can
# raise something else (KeyError: 'sglang', from the half-imported package), and each benchmark
# row would then report a different, misleading reason.
_IMPORT_FAILURE: list[str] = []


def _import_entry() -> tuple[ModuleType, type]:
    """SGLang's fused-MoE module and its `MoeRunnerConfig`, or `NotSupportedError` with the
    reason the first import failed."""
    if _IMPORT_FAILURE:
        raise NotSupportedError(_IMPORT_FAILURE[0])
    try:
        fm = importlib.import_module(ENTRY_MODULE)
        runner_config = importlib.import_module(RUNNER_CONFIG_MODULE).MoeRunnerConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means "no peer here"
        _IMPORT_FAILURE.append(f"SGLang is not importable here: {type(exc).__name__}: {exc}")
        raise NotSupportedError(_IMPORT_FAILURE[0]) from exc
    return fm, runner_config


def peer_callable(
    config: MoEConfig, w13: torch.Tensor, w2: torch.Tensor, device: torch.device | str
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`call(hidden, topk_ids, topk_weights)` running SGLang's fused experts on canonical BF16
    weights. Raises `NotSupportedError` (with the reason) where SGLang cannot run it."""
    if torch.device(device).type != "cuda":
        raise NotSupportedError("SGLang's Triton fused MoE runs on CUDA devices only")
    if config.activation is not Activation.SILU or not config.gated or config.has_w13_bias or config.has_w2_bias:
        raise NotSupportedError("the SGLang peer is wired for SiLU-and-mul without biases (the benchmark shapes)")
    # what the call below does not pass to SGLang: it would compute another layer
    unwired = {
        "routed_scaling_factor != 1": config.routed_scaling_factor != 1.0,
        "apply_router_weight_on_input": config.apply_router_weight_on_input,
        "ep_size > 1 (global ids on local weights)": config.ep_size > 1,
        "topk_padding (-1 ids)": config.topk_padding,
    }
    if any(unwired.values()):
        names = ", ".join(k for k, v in unwired.items() if v)
        raise NotSupportedError(f"the SGLang peer does not pass {names} to SGLang (the benchmark shapes use none)")
    fm, runner_config = _import_entry()
    e = config.num_local_experts
    rc = runner_config(num_experts=e, num_local_experts=e, activation="silu", is_gated=True, inplace=False)
    w13 = w13.to(device, config.dtype).contiguous()
    w2 = w2.to(device, config.dtype).contiguous()

    def call(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():  # SGLang's custom op skips the dispatcher then, as in serving
            return fm.fused_experts(x, w13, w2, (wts.float(), ids.int(), None), rc)

    return call


# (local experts, intermediate size) -> what `config_source` found, the first time it asked
_CONFIG_SOURCES: dict[tuple[int, int], str] = {}


def config_source(config: MoEConfig) -> str:
    """Which kernel config SGLang runs for this layer's bf16 experts on this GPU: "tuned" (a
    config file it ships for this Triton release), "tuned for Triton X" (its fallback to another
    release's file), "default" (no file: its untuned default tiles), or "unknown: why".

    Why: issue #4's prefill goal compares against SGLang's *tuned* Triton path, and SGLang ships
    no tuned file for some benchmark shapes (DeepSeek-V3's EP8 slice, Mixtral on an H100). The
    goals then mark those cells (`moehal.bench_goals`). It asks SGLang's own lookup,
    `get_moe_configs(E, N, None)` (`N`: the intermediate size, `None`: bf16), which its fused
    experts call with the same arguments. That lookup is cached and says a fallback only in a
    warning, so the first answer per shape is kept here, and this must run before the peer's
    first call."""
    import logging

    key = (config.num_local_experts, config.intermediate_size)
    if key in _CONFIG_SOURCES:
        return _CONFIG_SOURCES[key]
    mod = None
    for name in TUNED_CONFIG_MODULES:
        try:
            mod = importlib.import_module(name)
            break
        except Exception:  # noqa: BLE001 - another layout of SGLang: try the next
            continue
    if mod is None or not hasattr(mod, "get_moe_configs"):
        return "unknown: SGLang's get_moe_configs is not importable here"
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger(mod.__name__)
    handler = _Keep(logging.WARNING)
    log.addHandler(handler)
    try:
        configs = mod.get_moe_configs(*key, None)
    except Exception as exc:  # noqa: BLE001 - SGLang's lookup failed: say so, do not guess
        return f"unknown: {type(exc).__name__}: {exc}"
    finally:
        log.removeHandler(handler)
    fallback = [m for m in seen if "Fallback to triton version" in m]
    if not configs:
        found = "default"
    elif fallback:
        version = fallback[0].split("Fallback to triton version", 1)[1].split()[0].rstrip(".")
        found = f"tuned for Triton {version}"
    else:
        found = "tuned"
    _CONFIG_SOURCES[key] = found
    return found
