"""Typed errors. Every message says what was wrong and what to do about it."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from moehal.selection import CandidateDecision


class MoEHalError(Exception):
    """Base class of every error moehal raises on purpose."""


class ConfigError(MoEHalError, ValueError):
    """A MoEConfig, QuantScheme or routing setting is inconsistent."""


class InputError(MoEHalError, ValueError):
    """A forward input has the wrong dtype, shape, device or values."""


class WeightError(MoEHalError, ValueError):
    """Weights are missing, have the wrong shape/dtype, or were loaded twice."""


class WeightsNotLoadedError(WeightError):
    """The layer was called before `load_weights`."""


class WeightsAlreadyProcessedError(WeightError):
    """`process_weights_after_loading` ran already; a second transform would corrupt them."""


class UnknownBackendError(MoEHalError, LookupError):
    """A backend name was asked for that no loaded plugin provides."""


class PluginLoadError(MoEHalError, RuntimeError):
    """A plugin failed to import or register (raised only in strict mode)."""


class PluginCheckError(MoEHalError, RuntimeError):
    """A plugin's capability check or format declaration raised instead of answering: a bug in
    that plugin. Selection stops there rather than pass over the plugin without a word."""

    @classmethod
    def raised(cls, qualname: str, backend: str, what: str, exc: BaseException) -> PluginCheckError:
        """The error for `what` (e.g. "a capability check") of implementation `qualname`."""
        return cls(
            f"{qualname}: {what} raised {type(exc).__name__}: {exc}. Checks must answer (accept or decline, "
            f"formats or none), not raise: this is a bug in plugin {backend!r}. Report it to its vendor; until "
            f"it is fixed, MOEHAL_DISABLE_PLUGINS={backend} skips the plugin"
        )

    @classmethod
    def answered(cls, qualname: str, backend: str, what: str, answer: object, expected: str) -> PluginCheckError:
        """The error for `what` of implementation `qualname` answering `answer`, not `expected`."""
        return cls(
            f"{qualname}: {what} answered {short_repr(answer)}, not {expected}: this is a bug in "
            f"plugin {backend!r}. Report it to its vendor; until it is fixed, MOEHAL_DISABLE_PLUGINS={backend} "
            "skips the plugin"
        )


def short_repr(answer: object) -> str:
    """A plugin's answer as an error message shows it: its repr, cut to 200 characters, and its type."""
    shown = repr(answer)
    return f"{shown if len(shown) <= 200 else shown[:197] + '...'} ({type(answer).__name__})"


class NoBackendError(MoEHalError, RuntimeError):
    """No (dispatcher, experts) pair or fused forward accepts this configuration.

    The message lists every candidate and the reason it declined.
    """

    def __init__(self, summary: str, decisions: Sequence[CandidateDecision] = ()) -> None:
        self.summary = summary
        self.decisions = list(decisions)
        lines = [summary]
        if self.decisions:
            lines.append("Candidates considered:")
            for d in self.decisions:
                lines.append(f"  - {d.name}: {'accepted' if d.ok else 'declined'}: {d.reason}")
        else:
            lines.append("No candidates are registered: run `moehal doctor` to see which plugins loaded.")
        super().__init__("\n".join(lines))


class ContractError(MoEHalError, TypeError):
    """A runner returned what its declared format does not allow (another output type, or rows
    of another shape): a plugin bug, named with the runner that returned it."""


class NotSupportedError(MoEHalError, NotImplementedError):
    """An implementation was asked for something it declared it does not do."""


class MoEHalWarning(UserWarning):
    """Base of moehal's warnings: `warnings.filterwarnings("error", category=MoEHalWarning)`
    turns them all into errors."""


class SettingsWarning(MoEHalWarning):
    """A setting (a `MOEHAL_*` variable or `Settings` field) that names no installed plugin:
    a typo would otherwise disable or emulate nothing, silently."""


class DeprecatedSettingWarning(SettingsWarning, FutureWarning):
    """A deprecated `MOEHAL_*` variable is set (MOEHAL_NPU_EMULATE: use MOEHAL_EMULATE=npu). A
    FutureWarning too, not a DeprecationWarning: the variable is set by whoever runs the
    program, and Python hides DeprecationWarnings raised outside `__main__` by default."""


def warn(message: str, category: type[Warning]) -> None:
    """`warnings.warn` attributed to the first frame outside moehal's packages and torch.nn's
    call wrappers: the user's line, however deep (a forward hook, a direct `forward` call, an
    integration) the call came from. A fixed `stacklevel` points into moehal or torch there."""
    import os
    import sys

    internal = tuple(_internal_dirs())
    level, frame = 2, sys._getframe(1)  # stacklevel 2: warn's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _internal_dirs() -> list[str]:
    import os
    import sys

    dirs = []
    for name in ("moehal", "moehal_cuda", "moehal_npu", "moehal_rocm", "moehal_conformance", "torch.nn.modules"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep)
    return dirs


class FallbackWarning(MoEHalWarning):
    """A layer on an accelerator runs on a slow catch-all (the reference experts, ROCm's torch
    experts) because no native kernel took its configuration. It computes right, but loops over
    experts in float32 on weights dequantized at load (4x an fp8 checkpoint's bytes, 8x an NVFP4
    one's). Not raised where the caller asked for that backend by name, nor on a CPU."""


class InferenceOnlyWarning(MoEHalWarning):
    """A forward was called with autograd recording and inputs that require grad: moehal's
    kernels have no backward, so the layer runs without recording and its output carries no
    gradient (the same on every backend). Train with another implementation."""
