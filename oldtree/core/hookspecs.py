"""The plugin contract: every hook a moehal backend may implement.

A backend is a Python module (or object) registered under the entry-point group
`moehal.backends`; the entry-point name is the backend's name. In-tree backends register
exactly like third-party ones. Implement hooks with `@moehal.hookimpl`; each hook is
called once, at discovery, and returns declarations. Nothing here runs per forward.

Example (a vendor's `pyproject.toml`)::

    [project.entry-points."moehal.backends"]
    acme = "acme_moehal.plugin"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from moehal.interfaces import BackendInfo, Dispatcher, Experts, FusedForward, WeightProcessor

PROJECT = "moehal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def moehal_backend_info() -> BackendInfo:
    """Describe this backend for `moehal doctor`: name, version, whether it is available on
    the current hardware (with the reason if not) and the versions of its vendor libraries.

    Must not import vendor libraries that may be missing: use `importlib.util.find_spec`
    or import inside the `available` callable and turn failures into a declined Decision.
    Every plugin must implement this hook.
    """


@hookspec
def moehal_dispatchers() -> Sequence[Dispatcher]:
    """Return the dispatchers this backend provides (token movement: permute, DeepEP, HCCL).

    Each declares, through `can_produce`, the activation formats it can emit. Return all of
    them even when the hardware is absent: their `supports` answers decline with a reason,
    which `moehal explain` shows.
    """


@hookspec
def moehal_experts() -> Sequence[Experts]:
    """Return the experts kernels this backend provides (grouped GEMMs with activation).

    Each declares, through `input_formats`, the formats it consumes, best first. The core
    configures the chosen dispatcher to produce exactly that format.
    """


@hookspec
def moehal_fused_forwards() -> Sequence[FusedForward]:
    """Return fused forwards: one kernel doing dispatch, experts and combine (and routing,
    if it declares `accepts = {'logits'}`), such as Ascend FuseEP `fused_deep_moe` or
    FlashInfer TensorRT-LLM MoE. They compete with (dispatcher, experts) pairs by priority.
    """


@hookspec
def moehal_weight_processors() -> Sequence[WeightProcessor]:
    """Return weight processors: canonical weights -> a kernel's weight layout.

    An experts kernel or fused forward names the layout it needs in `weight_layout`; the
    processor whose `layout` matches runs exactly once, after `MoELayer.load_weights`.
    The `canonical` layout needs no processor.
    """
