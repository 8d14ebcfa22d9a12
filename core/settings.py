"""The one configuration surface: a typed `Settings`, read from the environment once.

Precedence, highest first: arguments passed in code (`MoELayer(backend=...)`,
`discover(strict=...)`), then these variables, then defaults. There is exactly one
variable per setting; no variable overrides another.

| variable                 | setting           | meaning                                              |
|--------------------------|-------------------|------------------------------------------------------|
| MOEHAL_BACKEND           | backend           | force experts/fused forwards of this backend         |
| MOEHAL_DISABLE_PLUGINS   | disabled_plugins  | comma-separated plugin names not to load             |
| MOEHAL_STRICT_PLUGINS    | strict            | 1: a plugin that fails to load raises                |
| MOEHAL_EMULATE           | emulate           | comma-separated backends allowed to run in emulated mode |
| MOEHAL_NPU_EMULATE       | emulate += {npu}  | the NPU backend's documented switch (same setting)  |
| MOEHAL_MASKED_WORKSPACE_GIB | masked_workspace_gib | GiB for worst-case masked buffers (default 8) |

`masked_workspace_gib`: a masked layout `[local_experts, max_tokens, hidden]` must be sized for
the worst case (every token at one expert), so its buffers grow with experts x max_tokens (x
ep_size behind an expert-parallel dispatcher: every rank may send its batch to one expert). Experts
that can consume either masked or contiguous input prefer masked (faster on DeepGEMM at every
batch size measured) only while their masked buffers fit this budget. Buffers are shared by all
layers of one shape, so this is a per-process cost, not a per-layer one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from moehal.errors import ConfigError

DEFAULT_MASKED_WORKSPACE_GIB = 8.0


def _names(value: str | None) -> frozenset[str]:
    return frozenset(n.strip() for n in (value or "").split(",") if n.strip())


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True, slots=True)
class Settings:
    backend: str | None = None
    disabled_plugins: frozenset[str] = field(default_factory=frozenset)
    strict: bool = False
    emulate: frozenset[str] = field(default_factory=frozenset)
    masked_workspace_gib: float = DEFAULT_MASKED_WORKSPACE_GIB

    def __post_init__(self) -> None:
        if not self.masked_workspace_gib >= 0:  # NaN too
            raise ConfigError(f"Settings.masked_workspace_gib must be >= 0, got {self.masked_workspace_gib}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        emulate = set(_names(env.get("MOEHAL_EMULATE")))
        if _flag(env.get("MOEHAL_NPU_EMULATE")):
            emulate.add("npu")
        backend = (env.get("MOEHAL_BACKEND") or "").strip() or None
        gib = (env.get("MOEHAL_MASKED_WORKSPACE_GIB") or "").strip()
        try:
            masked_gib = float(gib) if gib else DEFAULT_MASKED_WORKSPACE_GIB
        except ValueError:
            masked_gib = math.nan  # refused below, with the variable's name
        if not masked_gib >= 0:  # NaN too
            raise ConfigError(f"MOEHAL_MASKED_WORKSPACE_GIB must be a number of GiB >= 0, got {gib!r}")
        return cls(
            backend=None if backend == "auto" else backend,
            disabled_plugins=_names(env.get("MOEHAL_DISABLE_PLUGINS")),
            strict=_flag(env.get("MOEHAL_STRICT_PLUGINS")),
            emulate=frozenset(emulate),
            masked_workspace_gib=masked_gib,
        )
