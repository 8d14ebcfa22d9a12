"""Fast Triton launches: `kernel[grid](*args, **kwargs)` through the compiled kernel's own
launcher once Triton has compiled and launched that specialization (for #4's "host overhead
under 20 us per forward outside graphs").

Why: on the device hosts one `JITFunction.run` cost 18-33 us of host time, the compiled
kernel's launcher alone 7-11 us (`tools/host_floor.py`). Most of the difference is per launch
and not per argument: option strings and cache keys, knob reads, the global-value check,
launch metadata, two empty hook chains. An eager forward makes 4-6 launches; with this module
it took 15-24% less host time on H100 hosts (docs/device-runs/2026-11-23-session15).

How it stays exact: each launch is keyed by what Triton specializes a kernel on, with the
NVIDIA backend's rules (`triton.backends.compiler.BaseBackend`): per tensor its dtype and
whether its address is 16-byte aligned; per int whether it is 1, a multiple of 16, and its
integer width; per constexpr its value; plus the launch options and the current device. A key
never seen goes through `JITFunction.run` (compiling if needed), and the kernel it returns is
kept under the key. A host-side `TensorDescriptor` (TMA weight tiles) is keyed by everything it
holds but its base address: dtype, shape, strides, block shape and padding, and whether the
base is 16-byte aligned. The key is at least as fine as Triton's, so a kept kernel is the one
Triton would pick. Anything else (other backends, the interpreter, tuple arguments, launch
hooks such as a profiler's, a callable grid) takes `JITFunction.run` every time.
`VERIFY = True` (the GPU tests) asks Triton for its own choice at every hit and raises on a
difference.

Pinned sites (`site`): a launch that a bound forward makes at every call, with its grid,
constexprs and options fixed when it is bound. At its second launch a site keeps the kernel
and a check generated from that launch's key, which compares each positional argument with what
the key holds (a tensor's dtype and alignment, an int's specialization, ...): no key tuple, no
hashing, no keyword dict per call. The check is the key's own content, so a pinned launch is
the launch the key would pick; any difference takes the keyed path above (and pins again). A
pinned launch gives the launcher each GPU tensor as the address the check has read, so Triton's
launcher skips its own `data_ptr()` call and driver query per tensor (`RAW_POINTERS`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from moehal.kernels.host import kernel_modules_interpreted

INTERPRETED = kernel_modules_interpreted()  # the mode of the kernels it launches (host.py)

ENABLED = True  # diagnostics (A/B of host time): False sends every launch through JITFunction.run
VERIFY = False  # tests: check each fast launch against Triton's own choice of compiled kernel
PINNED = True  # diagnostics (A/B of host time): False sends a site's launches through the keyed path
RAW_POINTERS = True  # diagnostics (A/B of host time): False gives a pinned launch's tensors to Triton's launcher
_DEVICE_FLAG = "is_cuda"  # the Tensor attribute that says its memory is the GPU's (a CPU test's seam)


class _NoKey(Exception):
    """An argument whose specialization this module does not model: take Triton's path."""


@functools.cache
def _descriptor() -> tuple[type | None, tuple[str, ...]]:
    """Triton's host-side `TensorDescriptor` class and its fields other than the base tensor
    (None where this Triton has none)."""
    try:
        import dataclasses

        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None, ()
    return TensorDescriptor, tuple(f.name for f in dataclasses.fields(TensorDescriptor) if f.name != "base")


def _spec(value: Any) -> Any:
    """What Triton's NVIDIA backend specializes a non-constexpr argument on, or finer."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, not (value.data_ptr() & 15))
    kind = type(value)
    if kind is int:  # 1 -> constexpr; % 16 -> divisibility; the width -> i32 / i64 / u64
        return (value == 1, not (value & 15), -0x80000000 <= value < 0x80000000, value >= 1 << 63)
    if kind is float or kind is bool or value is None:  # fp32 / u1 / constexpr None: no value attribute
        return kind
    desc, fields = _descriptor()
    if kind is desc:
        # Triton types a descriptor by its dtype and block shape; its shape and strides travel
        # as launch arguments. Every field but the base address is in the key: finer than Triton.
        base = value.base
        held = tuple(tuple(v) if isinstance(v, list) else v for v in (getattr(value, f) for f in fields))
        return (kind, base.dtype, not (base.data_ptr() & 15), held)
    raise _NoKey


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: Triton 3.6+ keeps a `HookChain` (empty: none) where older
    releases kept None or a function."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """Wraps a `@triton.jit` kernel: `Launcher(kernel)[grid](*args, **kwargs)` launches exactly
    as `kernel[grid](...)` does, with less host time once a specialization has been launched.
    `hits` and `misses` count fast and Triton-path launches; `pinned`, the hits of its sites'
    pinned launches (`Site`)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        params = fn.params
        self._constexpr = tuple(p.is_constexpr for p in params)
        self._names = tuple(p.name for p in params)
        self._kw_spec = {p.name: not p.is_constexpr for p in params}  # by name: spec (True) or value
        self._spec_names = frozenset(p.name for p in params if not p.is_constexpr)
        self._keyers: dict[int, Callable[..., tuple[Any, ...]]] = {}  # positional count -> key function
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._cache: dict[Any, tuple[Any, ...]] = {}
        self._checks: dict[tuple[Any, ...], Callable[..., Any]] = {}  # key entries -> check factory
        self._driver: Any = None  # (get_current_device, get_current_stream) or False: Triton's path only
        self.hits = 0
        self.misses = 0
        self.pinned = 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self._launch, grid)

    def _drivers(self) -> Any:
        try:
            from triton import knobs
            from triton.runtime import driver

            active = driver.active
            ok = active.get_current_target().backend == "cuda"
            # torch.cuda.current_device() minus its lazy-init check: CUDA is up once a kernel launches
            device = getattr(torch._C, "_cuda_getDevice", None) or active.get_current_device
            self._driver = (device, active.get_current_stream, knobs.runtime) if ok else False
        except Exception:  # no GPU here (AOT compiles record launches without one): Triton's path
            self._driver = False
        return self._driver

    def _key(self, device: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The launch's key: (device, positional count, each positional argument's `_spec` or
        constexpr value, ((keyword, its `_spec` or value), ...)). A launch option (num_warps,
        ...) or a constexpr counts by value."""
        if self._spec_names.isdisjoint(kwargs):  # the usual call: keywords are constexprs and options
            keyer = self._keyers.get(len(args))
            if keyer is None:
                keyer = self._keyers[len(args)] = self._make_keyer(len(args))
            return keyer(device, args, kwargs)
        return self._key_generic(device, args, kwargs)

    def _key_generic(self, device: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        const, by_spec = self._constexpr, self._kw_spec
        named = tuple((name, _spec(v) if by_spec.get(name, False) else v) for name, v in kwargs.items())
        return (device, len(args), *(a if const[i] else _spec(a) for i, a in enumerate(args)), named)

    def _make_keyer(self, n: int) -> Callable[..., tuple[Any, ...]]:
        """`_key` for calls with `n` positional arguments and value keywords, as one generated
        expression (as Triton generates its binder): the per-argument function calls and the
        loop cost about a third of the key on the device hosts (session 15)."""
        if n > len(self._constexpr):
            raise TypeError(f"{self.__name__} takes {len(self._constexpr)} arguments")  # Triton's path says so
        names = [f"a{i}" for i in range(n)]
        parts = []
        for i, a in enumerate(names):
            if self._constexpr[i]:
                parts.append(a)
            else:  # `_spec`, inlined for tensors and ints
                parts.append(
                    f"(({a}.dtype, not ({a}.data_ptr() & 15)) if {a}.__class__ is Tensor else "
                    f"({a} == 1, not ({a} & 15), -0x80000000 <= {a} < 0x80000000, {a} >= 1 << 63) "
                    f"if {a}.__class__ is int else spec({a}))"
                )
        unpack = f"    ({', '.join(names)},) = args\n" if n else ""
        items = "".join(p + ", " for p in parts)
        body = f"def key(device, args, kwargs):\n{unpack}    return (device, {n}, {items}tuple(kwargs.items()))\n"
        scope: dict[str, Any] = {"Tensor": torch.Tensor, "spec": _spec}
        exec(body, scope)  # noqa: S102 - generated from the kernel's parameter list only
        return scope["key"]

    def _slow(self, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.misses += 1
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def _launch(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        drivers = self._driver if self._driver is not None else self._drivers()
        if drivers is False or type(grid) is not tuple or not ENABLED:
            return self._slow(grid, args, kwargs)
        get_device, get_stream, runtime = drivers
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return self._slow(grid, args, kwargs)  # a profiler's hooks want Triton's launch path
        device = get_device()
        try:
            key = self._key(device, args, kwargs)
            entry = self._cache.get(key)
        except (_NoKey, TypeError):  # an argument we do not model, or an unhashable constexpr
            return self._slow(grid, args, kwargs)
        if entry is None:
            kernel = self._slow(grid, args, kwargs)
            if kernel is not None and not hasattr(kernel, "result"):  # compiled and launched
                tail = self._names[len(args) :]  # parameters not given positionally
                # with no tensor or int by keyword, those are constexprs, options and defaults:
                # values the key holds, so the launcher's trailing arguments are fixed
                fixed = None
                if self._spec_names.isdisjoint(kwargs):
                    fixed = tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in tail)
                self._cache[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail, fixed, kernel)
            return kernel
        run, function, metadata, tail, fixed, kernel = entry
        if VERIFY:
            expected = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            if expected is not kernel:
                raise RuntimeError(f"fast launch of {self.__name__} picked another compiled kernel than Triton")
        if fixed is None:
            defaults = self._defaults
            fixed = tuple(kwargs[n] if n in kwargs else defaults[n] for n in tail)
        n = len(grid)
        run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, get_stream(device),
            function, metadata, None, None, None, *args, *fixed,
        )  # fmt: skip
        self.hits += 1
        return kernel

    def pin(self, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Pin | None:
        """The kept kernel of this launch, with a check that later arguments have its key (for
        `Site`); None where the launch takes Triton's path, or none is kept yet."""
        drivers = self._driver
        if not drivers or type(grid) is not tuple or not self._spec_names.isdisjoint(kwargs):
            return None
        device = drivers[0]()
        try:
            key = self._key(device, args, kwargs)
            entry = self._cache.get(key)
        except (_NoKey, TypeError):
            return None
        if entry is None:  # (its trailing arguments are fixed: no tensor or int came by keyword)
            return None
        run, function, metadata, _, fixed, kernel = entry
        n = len(grid)
        dims = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        prepare = self._make_prepare(args, key[2 : 2 + len(args)], fixed)
        return _Pin(device, key, prepare, dims, run, function, metadata, kernel)

    def _make_prepare(
        self, args: tuple[Any, ...], specs: tuple[Any, ...], fixed: tuple[Any, ...]
    ) -> Callable[[tuple[Any, ...], bool], tuple[Any, ...] | None]:
        """`prepare(args, raw)`: the launcher's kernel arguments for positional `args` (then the
        pinned launch's `fixed` trailing ones) if `args` have these key entries (`_key`'s
        per-argument part for the pinned launch's `args`), else None. Generated as straight-line
        code like `_make_keyer`'s. A bound forward passes the same int and float objects at
        every call (strides, sizes, scalars), so those are compared by identity first.

        With `raw`, a tensor whose memory is the GPU's (as the pinned launch's was) goes to the
        launcher as its address, which the check reads anyway for the alignment: Triton's
        launcher takes an int as the address itself, where for a tensor it calls `data_ptr()`
        and asks the driver whether the address is device memory (`cuPointerGetAttribute`),
        per tensor per launch. A tensor that is not on the GPU fails the check, and the keyed
        path gives it to Triton, which refuses it as it always did.

        The generated code depends on the entries only and is kept per entries: pinning again
        (another token count's launch, or a launch bound anew) costs a dictionary lookup, not a
        compile (about 0.6 ms)."""
        device = tuple(bool(getattr(a, _DEVICE_FLAG)) if isinstance(a, torch.Tensor) else None for a in args)
        entries = (specs, device)
        factory = self._checks.get(entries)
        if factory is None:
            factory = self._checks[entries] = self._prepare_factory(specs, device)
        return factory(*args, fixed)

    def _prepare_factory(
        self, specs: tuple[Any, ...], device: tuple[bool | None, ...]
    ) -> Callable[..., Callable[[tuple[Any, ...], bool], tuple[Any, ...] | None]]:
        scope: dict[str, Any] = {"Tensor": torch.Tensor, "spec": _spec}
        lines = []
        for i, want in enumerate(specs):
            a, s, v = f"a{i}", f"s{i}", f"v{i}"
            scope[s] = want
            if self._constexpr[i]:
                lines.append(f"if {a} != {s}: return None")
            elif type(want) is tuple and len(want) == 2 and isinstance(want[0], torch.dtype):  # a tensor
                scope[f"d{i}"] = want[0]
                misaligned = "p & 15" if want[1] else "not (p & 15)"
                lines.append(f"if {a}.__class__ is Tensor:")
                lines.append(f"    p = {a}.data_ptr()")
                if device[i]:  # pinned on the GPU: only GPU tensors pass, and go as addresses
                    lines.append(f"    if {a}.dtype is not d{i} or {misaligned} or not {a}.{_DEVICE_FLAG}: return None")
                    lines.append(f"    if raw: {a} = p")
                else:
                    lines.append(f"    if {a}.dtype is not d{i} or {misaligned} or {a}.{_DEVICE_FLAG}: return None")
                lines.append(f"elif spec({a}) != {s}: return None")
            elif type(want) is tuple and len(want) == 4 and all(type(b) is bool for b in want):  # an int
                one, div, i32, u64 = want
                lines.append(
                    f"if {a} is not {v} and not ({a}.__class__ is int and ({a} == 1) is {one} "
                    f"and (not ({a} & 15)) is {div} and (-0x80000000 <= {a} < 0x80000000) is {i32} "
                    f"and ({a} >= 1 << 63) is {u64}): return None"
                )
            elif want is float:
                lines.append(f"if {a} is not {v} and {a}.__class__ is not float: return None")
            else:  # bool, None, a descriptor: the general spec
                lines.append(f"if spec({a}) != {s}: return None")
        n = len(specs)
        names = "".join(f"a{i}, " for i in range(n))
        body = "".join(f"        {line}\n" for line in ([f"({names}) = args"] if n else []) + lines)
        code = (
            f"def factory({''.join(f'v{i}, ' for i in range(n))}fixed):\n"
            f"    def prepare(args, raw):\n        if len(args) != {n}:\n            return None\n{body}"
            f"        return ({names}*fixed,)\n"
            f"    return prepare\n"
        )
        exec(code, scope)  # noqa: S102 - generated from the kernel's parameters and one launch's key
        return scope["factory"]


@dataclass(frozen=True)
class _Pin:
    device: int
    key: tuple[Any, ...]
    prepare: Callable[[tuple[Any, ...], bool], tuple[Any, ...] | None]  # `Launcher._make_prepare`
    dims: tuple[Any, Any, Any]
    run: Any
    function: Any
    metadata: Any
    kernel: Any


class Site:
    """One launch site of a bound forward: `site(*args)` launches `kernel[grid](*args, **kwargs)`
    with the grid and keywords (constexprs, launch options) given when it was made. Its first
    launches take the keyed path, and the second pins its kernel (a site used once costs no more
    than a keyed launch); later launches whose arguments have the same key go straight to the
    kept kernel's launcher (see the module's note). `pinned` counts those."""

    __slots__ = ("kernel", "grid", "kwargs", "pinned", "_pin", "_keyed")

    def __init__(self, kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> None:
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs
        self.pinned = 0
        self._pin: _Pin | None = None
        self._keyed = 0  # launches through the keyed path

    def __call__(self, *args: Any) -> Any:
        pin = self._pin
        if pin is not None and PINNED and ENABLED:
            get_device, get_stream, runtime = self.kernel._driver
            hooked = _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)
            launch_args = None if hooked or get_device() != pin.device else pin.prepare(args, RAW_POINTERS)
            if launch_args is not None:
                if VERIFY:
                    self._verify(pin, args)
                g0, g1, g2 = pin.dims
                stream = get_stream(pin.device)
                pin.run(g0, g1, g2, stream, pin.function, pin.metadata, None, None, None, *launch_args)
                self.pinned += 1
                self.kernel.hits += 1
                self.kernel.pinned += 1
                return pin.kernel
        kernel = self.kernel
        if not isinstance(kernel, Launcher):  # the interpreter: Triton's own launch
            return kernel[self.grid](*args, **self.kwargs)
        launched = kernel._launch(self.grid, *args, **self.kwargs)
        self._keyed += 1
        if self._keyed > 1 and PINNED and ENABLED:
            self._pin = kernel.pin(self.grid, args, self.kwargs)
        return launched

    def _verify(self, pin: _Pin, args: tuple[Any, ...]) -> None:
        key = self.kernel._key(pin.device, args, self.kwargs)
        if key != pin.key:
            raise RuntimeError(f"pinned launch of {self.kernel.__name__}: the arguments' key changed, its check passed")
        expected = self.kernel.fn.run(*args, grid=self.grid, warmup=True, **self.kwargs)
        if expected is not pin.kernel:
            raise RuntimeError(f"pinned launch of {self.kernel.__name__} picked another compiled kernel than Triton")


def site(kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> Site:
    """A pinned launch site of `kernel` (a `fast_launch` kernel, or a plain `@triton.jit` one
    under the interpreter) with this grid and these keywords; call it with the positional
    arguments."""
    return Site(kernel, tuple(grid), kwargs)


def fast_launch(fn: Any) -> Any:
    """Decorator under `@triton.jit`: the kernel launches through a `Launcher`. Under Triton's
    interpreter the kernel is returned as it is (there is no compiled kernel to launch)."""
    if INTERPRETED or not hasattr(fn, "params"):
        return fn
    return Launcher(fn)
