"""Plugin discovery and the registry of declared implementations.

`discover()` loads every `moehal.backends` entry point once per process. A plugin that fails
to import, or whose hooks raise, is recorded (name, distribution, error) and skipped; with
strict mode it raises `PluginLoadError` instead. Nothing is chosen here: choosing is
`moehal.selection`'s job, by explicit priority.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

import pluggy
from moehal import hookspecs
from moehal.errors import PluginLoadError, SettingsWarning, UnknownBackendError, short_repr, warn
from moehal.interfaces import BackendInfo, Dispatcher, Experts, FusedForward, Implementation, WeightProcessor
from moehal.routing import RoutingMethod
from moehal.settings import Settings

_log = logging.getLogger(__name__)

# The in-tree backends' entry-point names and the distribution that owns them
RESERVED_NAMES = {name: "moehal" for name in ("reference", "cuda", "npu", "rocm")}

ENTRY_POINT_GROUP = "moehal.backends"
Status = Literal["loaded", "failed", "disabled"]


@dataclass
class PluginRecord:
    """What happened to one plugin at discovery (shown by `moehal doctor`)."""

    name: str
    status: Status
    distribution: str | None = None
    version: str | None = None
    module: str | None = None
    error: str | None = None
    traceback: str | None = None
    info: BackendInfo | None = None
    implementations: list[str] = field(default_factory=list)


_COLLECT = {
    "dispatchers": ("moehal_dispatchers", Dispatcher),
    "experts": ("moehal_experts", Experts),
    "fused": ("moehal_fused_forwards", FusedForward),
    "processors": ("moehal_weight_processors", WeightProcessor),
}


class Registry:
    """Loaded plugins and the implementations they declared."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginRecord] = {}
        self.dispatchers: list[Dispatcher] = []
        self.experts: list[Experts] = []
        self.fused: list[FusedForward] = []
        self.processors: list[WeightProcessor] = []

    # Loading ---------------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        """Load every `moehal.backends` entry point, in name order. A name that more than one
        distribution provides loads none of them: which one would win is install order, which
        moehal never chooses by. A disabled name is not imported at all. The in-tree backends'
        names (`RESERVED_NAMES`) load from moehal's own distribution only: another plugin of that
        name would otherwise disable moehal's backend, the reference oracle included."""
        providers: dict[str, list[Any]] = {}
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
            providers.setdefault(ep.name, []).append(ep)
        for name, eps in providers.items():
            self._load_name(name, eps)
            if name in RESERVED_NAMES:  # another distribution's plugin of this name loads nowhere
                for ep in eps:
                    if not _owns(ep, name):
                        dist_name, dist_version = _distribution(ep)
                        self._fail(
                            PluginRecord(name, "failed", dist_name, dist_version, ep.value),
                            f"the backend name {name!r} is moehal's own (in-tree backends: "
                            f"{', '.join(sorted(RESERVED_NAMES))}); {dist_name or ep.value} must register "
                            "its plugin under another entry-point name",
                            None,
                        )
        self._warn_unknown_names()

    def _load_name(self, name: str, eps: list[Any]) -> None:
        """One entry-point name: its provider loaded, or each refusal recorded."""
        if name in RESERVED_NAMES:
            eps = [ep for ep in eps if _owns(ep, name)]
            if not eps:
                return
        ep = eps[0]
        dist_name, dist_version = _distribution(ep)
        if name in self.settings.disabled_plugins:
            self.plugins[name] = PluginRecord(
                name, "disabled", dist_name, dist_version, ep.value, error="disabled by MOEHAL_DISABLE_PLUGINS"
            )
            return
        if len(eps) > 1:
            named = ", ".join(f"{_distribution(e)[0] or '?'} ({e.value})" for e in eps)
            self._fail(
                PluginRecord(name, "failed", dist_name, dist_version, ep.value),
                f"plugin name {name!r} is provided by {len(eps)} distributions: {named}. moehal loads "
                "none of them rather than pick one by install order; uninstall all but one",
                None,
            )
            return
        if name in self.plugins:  # registered by the application before the entry points
            self._fail(
                PluginRecord(name, "failed", dist_name, dist_version, ep.value),
                f"duplicate plugin name {name!r}: already provided by "
                f"{self.plugins[name].distribution or self.plugins[name].module}",
                None,
            )
            return
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not fatal
            self._fail(
                PluginRecord(name, "failed", dist_name, dist_version, ep.value),
                f"import failed: {type(exc).__name__}: {exc}",
                traceback.format_exc(),
            )
            return
        self.register(plugin, name, distribution=dist_name, version=dist_version, module=ep.value)

    def _warn_unknown_names(self) -> None:
        """Settings that name no installed plugin: a typo (`cdua`) otherwise disabled or emulated
        nothing, silently."""
        known = set(self.plugins)
        for var, field_name in (("MOEHAL_DISABLE_PLUGINS", "disabled_plugins"), ("MOEHAL_EMULATE", "emulate")):
            unknown = sorted(getattr(self.settings, field_name) - known)
            if unknown:
                warn(
                    f"{var} (Settings.{field_name}) names "
                    f"{', '.join(unknown)}, which no installed plugin is; installed: {', '.join(sorted(known))}",
                    SettingsWarning,
                )

    def register(
        self,
        plugin: Any,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
        module: str | None = None,
    ) -> PluginRecord:
        """Register a plugin object (module or instance) under a backend name.

        Used for entry points and directly by tests and applications.
        """
        record = PluginRecord(name, "loaded", distribution, version, module or getattr(plugin, "__name__", None))
        if name in self.plugins and self.plugins[name].status == "loaded":
            return self._fail(record, f"a plugin named {name!r} is already loaded", None)
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors
            return self._fail(record, f"registration rejected: {type(exc).__name__}: {exc}", traceback.format_exc())
        try:
            self.pm.check_pending()
            collected = self._collect(name)
        except Exception as exc:  # noqa: BLE001 - a plugin's hook raised
            self.pm.unregister(name=name)
            return self._fail(record, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        record.info = collected.pop("info")
        for attr, impls in collected.items():
            getattr(self, attr).extend(impls)
            record.implementations.extend(i.qualname for i in impls)
        if record.version is None:
            record.version = record.info.version
        self.plugins[name] = record
        return record

    def _collect(self, name: str) -> dict[str, Any]:
        def call(hook_name: str) -> list[Any]:
            hook = getattr(self.pm.hook, hook_name)
            return [impl.function() for impl in hook.get_hookimpls() if impl.plugin_name == name]

        infos = [i for i in call("moehal_backend_info") if i is not None]
        if len(infos) != 1:
            raise PluginLoadError(f"plugin {name!r} must implement moehal_backend_info exactly once")
        _check_info(infos[0])
        out: dict[str, Any] = {"info": infos[0]}
        known = {i.qualname for i in self.all_implementations()}
        for attr, (hook_name, base) in _COLLECT.items():
            impls: list[Implementation] = []
            for result in call(hook_name):
                if result is not None and (not isinstance(result, Sequence) or isinstance(result, (str, bytes))):
                    raise PluginLoadError(
                        f"{hook_name} returned {short_repr(result)}, not a list of {base.__name__} instances"
                    )
                for impl in result or ():
                    if not isinstance(impl, base):
                        raise PluginLoadError(f"{hook_name} returned {impl!r}, not a {base.__name__} instance")
                    _check_declarations(impl, hook_name)
                    impl.backend = name
                    if impl.qualname in known:
                        raise PluginLoadError(f"implementation {impl.qualname} declared twice")
                    known.add(impl.qualname)
                    impls.append(impl)
            out[attr] = impls
        return out

    def _fail(self, record: PluginRecord, error: str, tb: str | None) -> PluginRecord:
        record.status, record.error, record.traceback = "failed", error, tb
        # loud, not only recorded: a backend that silently vanished would leave a slower one chosen
        _log.warning(
            "moehal plugin %r failed to load; its kernels cannot be selected (`moehal doctor` shows why): %s",
            record.name,
            error,
        )
        key = record.name
        if key in self.plugins and self.plugins[key].status == "loaded":
            key = f"{record.name}@{record.distribution or record.module}"  # keep the loaded one visible
        self.plugins[key] = record
        if self.settings.strict:
            raise PluginLoadError(f"moehal plugin {record.name!r} failed to load: {error}\n{tb or ''}")
        return record

    # Queries ---------------------------------------------------------------------------------
    def all_implementations(self) -> list[Implementation]:
        return [*self.dispatchers, *self.experts, *self.fused, *self.processors]

    def components(self, backend: str) -> list[tuple[str, Implementation]]:
        """(kind, implementation) of each dispatcher, experts kernel and fused forward that
        `backend` declares, highest priority first within each kind. Weight processors are left
        out: each serves the experts kernel it prepares weights for."""
        kinds = (("dispatcher", self.dispatchers), ("experts", self.experts), ("fused", self.fused))
        return [
            (kind, impl)
            for kind, impls in kinds
            for impl in sorted((i for i in impls if i.backend == backend), key=lambda i: (-i.priority, i.qualname))
        ]

    def loaded_backends(self) -> list[str]:
        return sorted(n for n, r in self.plugins.items() if r.status == "loaded")

    def failed(self) -> list[PluginRecord]:
        return [r for r in self.plugins.values() if r.status == "failed"]

    def check_backend(self, name: str) -> None:
        if name not in self.loaded_backends():
            rec = self.plugins.get(name)
            why = f" (it {rec.status}: {rec.error})" if rec is not None else ""
            raise UnknownBackendError(
                f"unknown backend {name!r}{why}; loaded backends: {self.loaded_backends()}. "
                "Run `moehal doctor` to see every plugin and why it is or is not available."
            )


def _check_declarations(impl: Implementation, hook_name: str) -> None:
    """An implementation's class attributes have the types selection reads, or the plugin fails
    to load with the attribute named. Else a `priority = "10"` or `quant_schemes = {"bf16"}`
    broke every layer's selection on the machine (sorting and matching run over all plugins),
    `backend="reference"` included, with an anonymous TypeError."""
    from moehal.config import Activation
    from moehal.quant import QuantScheme

    what = f"{hook_name}: {type(impl).__name__}"

    def bad(attr: str, want: str) -> PluginLoadError:
        return PluginLoadError(f"{what}.{attr} is {short_repr(getattr(impl, attr, None))}, not {want}")

    if not isinstance(getattr(impl, "name", None), str) or not impl.name or "." in impl.name:
        raise bad("name", "a non-empty str without dots")
    if not isinstance(impl.priority, int) or isinstance(impl.priority, bool):
        raise bad("priority", "an int")
    if not isinstance(impl.description, str):
        raise bad("description", "a str")
    for attr, kind in (("devices", str), ("quant_schemes", QuantScheme), ("activations", Activation)):
        value = getattr(impl, attr)
        if not isinstance(value, (set, frozenset)) or not all(isinstance(v, kind) for v in value):
            hint = " (moehal.QuantScheme.parse('bf16'), not 'bf16')" if kind is QuantScheme else ""
            raise bad(attr, f"a frozenset of {kind.__name__}{hint}")
    for attr in ("supports_non_gated", "supports_bias", "supports_router_weight_on_input", "graph_capturable",
                 "deterministic", "emulates", "fallback"):  # fmt: skip
        if not isinstance(getattr(impl, attr), bool):
            raise bad(attr, "a bool")
    _check_kind_declarations(impl, bad)


def _check_kind_declarations(impl: Implementation, bad: Callable[[str, str], PluginLoadError]) -> None:
    """The attributes each kind adds to `Implementation`'s, checked as `_check_declarations`
    checks those: a processor without `layout` once loaded, then broke every backend's
    selection (the lookup reads every processor's `layout`), and a truthy string in
    `drops_padding_ids` claimed that -1 ids were dropped."""

    def layout_name(attr: str, canonical_ok: bool) -> None:
        value = getattr(impl, attr, None)
        if not isinstance(value, str) or not value or (value == "canonical" and not canonical_ok):
            raise bad(attr, "a non-empty str" + ("" if canonical_ok else " other than 'canonical'"))

    flags: tuple[str, ...] = ()
    if isinstance(impl, Dispatcher):
        flags = ("drops_padding_ids", "same_wire_for_every_layout", "zero_padding")
    elif isinstance(impl, Experts):
        layout_name("weight_layout", canonical_ok=True)
    elif isinstance(impl, FusedForward):
        layout_name("weight_layout", canonical_ok=True)
        flags = ("drops_padding_ids",)
        accepts = impl.accepts
        if not isinstance(accepts, (set, frozenset)) or not accepts or not accepts <= {"topk", "logits"}:
            raise bad("accepts", "a non-empty frozenset of 'topk' and/or 'logits'")
        methods = impl.routing_methods
        if not isinstance(methods, (set, frozenset)) or not all(isinstance(m, RoutingMethod) for m in methods):
            raise bad("routing_methods", "a frozenset of moehal.RoutingMethod")
    elif isinstance(impl, WeightProcessor):
        layout_name("layout", canonical_ok=False)
    for attr in flags:
        if not isinstance(getattr(impl, attr), bool):
            raise bad(attr, "a bool")


def _check_info(info: Any) -> None:
    """`moehal_backend_info`'s answer is a `BackendInfo` that `moehal doctor` can show, or the
    plugin fails to load (before any of its implementations is added)."""
    if not isinstance(info, BackendInfo):
        raise PluginLoadError(f"moehal_backend_info returned {short_repr(info)}, not a moehal.BackendInfo")
    for attr in ("name", "version", "description"):
        if not isinstance(getattr(info, attr), str):
            raise PluginLoadError(
                f"moehal_backend_info's BackendInfo.{attr} is {short_repr(getattr(info, attr))}, not a str"
            )
    for attr in ("available", "libraries"):
        if not callable(getattr(info, attr)):
            raise PluginLoadError(
                f"moehal_backend_info's BackendInfo.{attr} is {short_repr(getattr(info, attr))}, not a callable"
            )


def _owns(ep: Any, name: str) -> bool:
    """Whether `ep` comes from the distribution that owns the reserved backend name `name`."""
    dist = (_distribution(ep)[0] or "").lower().replace("_", "-")
    return dist == RESERVED_NAMES[name]


def _distribution(ep: Any) -> tuple[str | None, str | None]:
    """(name, version) of the distribution that declares an entry point, where known."""
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)


_lock = threading.Lock()
_default: Registry | None = None


def discover(*, strict: bool | None = None, refresh: bool = False, settings: Settings | None = None) -> Registry:
    """Load all plugins once per process and return the shared registry, which layers built
    without `registry=` select from.

    strict: raise `PluginLoadError` on the first plugin that fails (default: MOEHAL_STRICT_PLUGINS).
    settings: the settings to load with (default: `Settings.from_env()`).
    refresh: forget the cached registry and load again (tests, or after installing a plugin).

    With `strict` or `settings`, the registry is the caller's own: pass it as
    `MoELayer(registry=...)`. It replaces the shared one only with `refresh=True` (one caller's
    settings changed every other caller's layers before).
    """
    global _default
    with _lock:
        own = strict is not None or settings is not None
        if _default is not None and not refresh and not own:
            return _default
        s = settings if settings is not None else Settings.from_env()
        if strict is not None:
            s = dataclasses.replace(s, strict=strict)
        reg = Registry(s)
        reg.load_entry_points()
        if refresh or not own:
            _default = reg
        return reg
