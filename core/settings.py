"""The one configuration surface: a typed `Settings`, read from the environment once.

Precedence, highest first: arguments passed in code (`MoELayer(backend=...)`,
`discover(strict=...)`), then these variables, then defaults. There is exactly one
variable per setting, and no variable overrides another. MOEHAL_NPU_EMULATE, the NPU
backend's switch from before MOEHAL_EMULATE, is a deprecated alias of MOEHAL_EMULATE=npu:
it still works, joined to MOEHAL_EMULATE, and warns (`DeprecatedSettingWarning`); where
the two disagree (MOEHAL_NPU_EMULATE=0 beside MOEHAL_EMULATE=npu) neither wins: `ConfigError`.
Booleans take 1/true/yes/on or 0/false/no/off; anything else raises `ConfigError`, naming
the variable.
Names that no installed plugin has, in MOEHAL_DISABLE_PLUGINS or MOEHAL_EMULATE, are warned
about when the plugins load.

| variable                 | setting           | meaning                                              |
|--------------------------|-------------------|------------------------------------------------------|
| MOEHAL_BACKEND           | backend           | force experts/fused forwards of this backend         |
| MOEHAL_DISABLE_PLUGINS   | disabled_plugins  | comma-separated plugin names not to load             |
| MOEHAL_STRICT_PLUGINS    | strict            | 1: a plugin that fails to load raises                |
| MOEHAL_EMULATE           | emulate           | comma-separated backends allowed to run in emulated mode |
| MOEHAL_NPU_EMULATE       | emulate += {npu}  | deprecated: use MOEHAL_EMULATE=npu (see above)       |
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
from typing import TYPE_CHECKING

from moehal.errors import ConfigError, DeprecatedSettingWarning, warn

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

DEFAULT_MASKED_WORKSPACE_GIB = 8.0


def _names(value: str | None) -> frozenset[str]:
    return frozenset(n.strip() for n in (value or "").split(",") if n.strip())


_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    """A boolean variable: True, False, or None where unset. Anything else is refused: a typo
    (`ture`, `enabled`) read as false switched a setting off silently."""
    value = env.get(name)
    if value is None:
        return None
    word = value.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: use 1/true/yes/on or 0/false/no/off")


@dataclass(frozen=True, slots=True)
class Settings:
    """moehal's configuration: `Settings.from_env()` reads the variables in this module's
    table; arguments passed in code override them (see the module docstring)."""

    backend: str | None = None
    disabled_plugins: frozenset[str] = field(default_factory=frozenset)
    strict: bool = False
    emulate: frozenset[str] = field(default_factory=frozenset)
    masked_workspace_gib: float = DEFAULT_MASKED_WORKSPACE_GIB

    if TYPE_CHECKING:
        # For type checkers only; at run time the dataclass makes __init__ from the fields. It
        # takes any set of names (`Settings(emulate={"npu"})`), which __post_init__ freezes, so
        # that the fields still read as frozensets. tests/core/test_config_types.py keeps it
        # equal to the fields.
        def __init__(
            self,
            backend: str | None = None,
            disabled_plugins: AbstractSet[str] = frozenset(),
            strict: bool = False,
            emulate: AbstractSet[str] = frozenset(),
            masked_workspace_gib: float = DEFAULT_MASKED_WORKSPACE_GIB,
        ) -> None: ...

    def __post_init__(self) -> None:
        # Settings built in code get the checks the variables get: a string for a set matched
        # substrings (`"npu" in "npu,rocm"`), and "no" for a bool was true.
        if self.backend is not None and not isinstance(self.backend, str):
            raise ConfigError(f"Settings.backend must be a backend name or None, got {self.backend!r}")
        if self.backend is not None and self.backend.strip().lower() == "auto":
            object.__setattr__(self, "backend", None)  # "auto" is automatic selection, as MOEHAL_BACKEND=auto
        for name in ("disabled_plugins", "emulate"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"Settings.{name} must be a set of names, got {value!r}")
            object.__setattr__(self, name, frozenset(value))
        if not isinstance(self.strict, bool):
            raise ConfigError(f"Settings.strict must be a bool, got {self.strict!r}")
        gib = self.masked_workspace_gib
        if isinstance(gib, bool) or not isinstance(gib, int | float) or not gib >= 0:  # NaN too
            raise ConfigError(f"Settings.masked_workspace_gib must be a number >= 0, got {gib!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        emulate = set(_names(env.get("MOEHAL_EMULATE")))
        npu = _flag(env, "MOEHAL_NPU_EMULATE")  # the deprecated alias of MOEHAL_EMULATE=npu
        if npu is False and "npu" in emulate:  # the two name one setting: neither may override the other
            raise ConfigError(
                f"MOEHAL_EMULATE={env.get('MOEHAL_EMULATE')!r} turns on the NPU backend's emulated mode and "
                f"MOEHAL_NPU_EMULATE={env.get('MOEHAL_NPU_EMULATE')!r} turns it off: unset MOEHAL_NPU_EMULATE "
                "(a deprecated alias) and keep npu in MOEHAL_EMULATE or drop it"
            )
        if npu is not None:
            warn(
                f"MOEHAL_NPU_EMULATE={env.get('MOEHAL_NPU_EMULATE')!r} is deprecated: unset it and use "
                "MOEHAL_EMULATE=npu (comma-separated with any other backends to emulate)",
                DeprecatedSettingWarning,
            )
        if npu:
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
            backend=None if backend is not None and backend.lower() == "auto" else backend,
            disabled_plugins=_names(env.get("MOEHAL_DISABLE_PLUGINS")),
            strict=bool(_flag(env, "MOEHAL_STRICT_PLUGINS")),
            emulate=frozenset(emulate),
            masked_workspace_gib=masked_gib,
        )
