"""SGLang's Triton fused-MoE experts as a benchmark peer (`moehal bench --backends sglang`).

The peer is SGLang's own function, called on the same problem as moehal (canonical weights
are SGLang's layout: w13 `[E, 2I, H]` rows [gate; up], w2 `[E, H, I]`; no copy):

    sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.fused_experts(
        hidden, w1, w2, (topk_weights, topk_ids, None), MoeRunnerConfig(...))

the entry point SGLang's Triton MoE runner calls, with its shipped tuned configs chosen by
SGLang itself per (E, N, device, M). BF16 with SiLU-and-mul only: that is what the issue
compares against. It is imported only when asked for; a machine without SGLang declines with
the import error. On the offline GPU machine SGLang is made importable by
`tools/sglang_peer.py`, which says exactly what it stubs (see docs/benchmarks.md).
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
