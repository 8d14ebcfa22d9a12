"""`moehal.kernels.launch`: which launches take the compiled kernel's launcher, in what argument
order, and when Triton's own path is kept. A stand-in kernel records both paths (CPU); the GPU
tests run every real kernel with `VERIFY` on (tests/cuda/test_fast_launch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moehal.kernels import launch
from triton.backends.compiler import BaseBackend


@dataclass
class Param:
    name: str
    is_constexpr: bool = False
    default: Any = None
    has_default: bool = False


@dataclass
class Compiled:
    """A compiled kernel: `run` is its launcher; one per specialization."""

    spec: tuple[Any, ...]
    launches: list[tuple[Any, ...]] = field(default_factory=list)
    function: str = "cufunction"
    packed_metadata: str = "meta"

    def run(self, *launch_args: Any) -> None:
        self.launches.append(launch_args)


class FakeJit:
    """`JITFunction`'s surface: params, and run() compiling per Triton's NVIDIA specialization."""

    def __init__(self, params: list[Param]) -> None:
        self.params = params
        self.__name__ = "fake_kernel"
        self.compiled: dict[tuple[Any, ...], Compiled] = {}
        self.jit_launches: list[tuple[Any, ...]] = []

    def _triton_spec(self, bound: dict[str, Any], options: dict[str, Any]) -> tuple[Any, ...]:
        from triton._C.libtriton import native_specialize_impl

        def spec(v: Any) -> Any:
            return native_specialize_impl(BaseBackend, v, False, True, True)

        out = [("constexpr", bound[p.name]) if p.is_constexpr else spec(bound[p.name]) for p in self.params]
        return (*out, tuple(sorted(options.items())))

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Compiled:
        names = [p.name for p in self.params]
        bound = dict(zip(names, args, strict=False))
        options = {k: v for k, v in kwargs.items() if k not in names}
        for p in self.params[len(args) :]:
            bound[p.name] = kwargs.get(p.name, p.default)
        spec = self._triton_spec(bound, options)
        kernel = self.compiled.setdefault(spec, Compiled(spec))
        if not warmup:
            self.jit_launches.append((grid, *bound.values()))
        return kernel


class HookChain:
    """Triton 3.6+'s hook holder: never None, empty when no hook is set."""

    def __init__(self) -> None:
        self.calls: list[Any] = []


class Runtime:
    def __init__(self) -> None:
        self.launch_enter_hook: Any = HookChain()
        self.launch_exit_hook: Any = None  # older Triton: None when unset


@pytest.fixture
def kernel():
    fn = FakeJit([Param("x"), Param("n"), Param("w"), Param("BLOCK", True), Param("FLAG", True, 7, True)])
    runner = launch.Launcher(fn)
    runtime = Runtime()
    runner._driver = (lambda: 0, lambda device: 1000 + device, runtime)  # device 0, stream 1000
    return fn, runner, runtime


def test_second_launch_takes_the_compiled_launcher_with_arguments_in_signature_order(kernel):
    fn, runner, _ = kernel
    x, w = torch.zeros(64), torch.ones(8)
    assert runner[(3,)](x, 64, w, BLOCK=32) is runner[(3,)](x, 64, w, BLOCK=32)
    assert (runner.misses, runner.hits, len(fn.jit_launches)) == (1, 1, 1)
    (compiled,) = fn.compiled.values()
    # grid padded to three dims, the current stream, no launch metadata or hooks, then every
    # parameter in order, the defaulted constexpr included
    assert compiled.launches == [(3, 1, 1, 1000, "cufunction", "meta", None, None, None, x, 64, w, 32, 7)]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x, n, w: (x[1:], n, w, {}), id="misaligned-tensor"),
        pytest.param(lambda x, n, w: (x.double(), n, w, {}), id="tensor-dtype"),
        pytest.param(lambda x, n, w: (x, 65, w, {}), id="int-not-multiple-of-16"),
        pytest.param(lambda x, n, w: (x, 1, w, {}), id="int-equal-to-1"),
        pytest.param(lambda x, n, w: (x, 2**40, w, {}), id="int-64-bit"),
        pytest.param(lambda x, n, w: (x, n, w, {"FLAG": 8}), id="constexpr-value"),
        pytest.param(lambda x, n, w: (x, n, w, {"num_warps": 8}), id="launch-option"),
        pytest.param(lambda x, n, w: (x, n, None, {}), id="tensor-to-none"),
    ],
)
def test_every_change_triton_specializes_on_is_a_new_key(kernel, change):
    fn, runner, _ = kernel
    x, w = torch.zeros(64), torch.ones(8)
    runner[(1,)](x, 64, w, BLOCK=32)
    x2, n2, w2, extra = change(x, 64, w)
    got = runner[(1,)](x2, n2, w2, BLOCK=32, **extra)
    assert runner.misses == 2 and runner.hits == 0  # Triton's path chose the kernel
    assert got is fn.compiled[next(reversed(fn.compiled))]
    assert len(fn.compiled) == 2  # and it was another specialization: the key had to differ
    runner[(1,)](x2, n2, w2, BLOCK=32, **extra)
    assert runner.hits == 1


def test_trailing_arguments_are_this_calls_values(kernel):
    """Constexprs and defaults after the positional arguments are fixed per key and kept with
    the kernel; a tensor passed by keyword is this call's, every call."""
    fn, runner, _ = kernel
    x, w1, w2 = torch.zeros(64), torch.ones(8), torch.full((8,), 2.0)
    for flag in (7, 9, 7):
        runner[(1,)](x, 64, w1, BLOCK=32, FLAG=flag)
    runner[(1,)](x, 64, w=w1, BLOCK=32)
    runner[(1,)](x, 64, w=w2, BLOCK=32)  # same key as the call before, another tensor
    launches = [call for c in fn.compiled.values() for call in c.launches]
    assert [call[9:] for call in launches] == [(x, 64, w1, 32, 7), (x, 64, w2, 32, 7)]


def test_values_triton_does_not_specialize_on_share_the_kernel(kernel):
    fn, runner, _ = kernel
    x, w = torch.zeros(64), torch.ones(8)
    runner[(1,)](x, 32, w, BLOCK=32)
    runner[(1,)](x, 48, w, BLOCK=32)  # another multiple of 16: same specialization, same key
    runner[(1,)](torch.zeros(64), 32, w, BLOCK=32)  # another aligned tensor
    assert (runner.misses, runner.hits, len(fn.compiled)) == (1, 2, 1)


def test_unmodelled_arguments_hooks_and_callable_grids_keep_tritons_path(kernel, monkeypatch):
    fn, runner, runtime = kernel
    x, w = torch.zeros(64), torch.ones(8)
    for _ in range(2):
        runner[(1,)](x, 64, (w, w), BLOCK=32)  # a tuple argument: not modelled
        runner[lambda meta: (1,)](x, 64, w, BLOCK=32)
    runtime.launch_enter_hook.calls.append(print)  # a profiler's hook, Triton 3.6+
    for _ in range(2):
        runner[(1,)](x, 64, w, BLOCK=32)
    runtime.launch_enter_hook.calls.clear()
    runtime.launch_exit_hook = print  # the same, older Triton
    runner[(1,)](x, 64, w, BLOCK=32)
    runtime.launch_exit_hook = None
    monkeypatch.setattr(launch, "ENABLED", False)
    runner[(1,)](x, 64, w, BLOCK=32)
    assert runner.hits == 0 and runner.misses == 8 and len(fn.jit_launches) == 8
    monkeypatch.setattr(launch, "ENABLED", True)
    for _ in range(2):  # no hooks: the first keeps the kernel, the second takes its launcher
        runner[(1,)](x, 64, w, BLOCK=32)
    assert runner.hits == 1 and runner.misses == 9


def test_verify_raises_when_the_kept_kernel_is_not_tritons_choice(kernel, monkeypatch):
    fn, runner, _ = kernel
    x, w = torch.zeros(64), torch.ones(8)
    runner[(1,)](x, 64, w, BLOCK=32)
    monkeypatch.setattr(launch, "VERIFY", True)
    runner[(1,)](x, 64, w, BLOCK=32)  # agrees
    for key in list(runner._cache):  # corrupt the kept kernel: verification must notice
        entry = runner._cache[key]
        runner._cache[key] = (*entry[:-1], Compiled(("other",)))
    with pytest.raises(RuntimeError, match="another compiled kernel"):
        runner[(1,)](x, 64, w, BLOCK=32)


def test_without_a_gpu_or_under_the_interpreter_launches_go_through_triton():
    fn = FakeJit([Param("x"), Param("BLOCK", True)])
    runner = launch.Launcher(fn)
    runner._driver = None
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the driver check would pass")
    runner[(1,)](torch.zeros(4), BLOCK=4)
    assert runner._driver is False and runner.misses == 1
    # under TRITON_INTERPRET the decorator leaves the kernel as it is
    assert launch.fast_launch(fn) is fn if launch.INTERPRETED else isinstance(launch.fast_launch(fn), launch.Launcher)


_values = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, 16, 17, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**31), -(2**31) - 1]),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.uint8]), st.integers(0, 7)).map(
        lambda dt_off: torch.zeros(16, dtype=dt_off[0])[dt_off[1] :]  # offsets: aligned and not
    ),
)


@settings(max_examples=150, deadline=None)
@given(args=st.lists(_values, min_size=0, max_size=5), block=st.integers(1, 256), warps=st.sampled_from([4, 8]))
def test_the_generated_key_equals_the_per_argument_key(args, block, warps):
    """The generated key function (`_make_keyer`) and the per-argument loop agree on every
    argument kind: one key, however it is computed."""
    params = [Param(f"p{i}") for i in range(len(args))] + [Param("BLOCK", True), Param("FLAG", True, 7, True)]
    runner = launch.Launcher(FakeJit(params))
    kwargs = {"BLOCK": block, "num_warps": warps}
    generated = runner._make_keyer(len(args))(0, tuple(args), kwargs)
    assert generated == runner._key_generic(0, tuple(args), kwargs)
    assert runner._key(0, tuple(args), kwargs) == generated
    # a non-constexpr parameter passed by keyword takes the per-argument path, same format
    if args:
        head, last = tuple(args[:-1]), args[-1]
        by_name = runner._key(0, head, {f"p{len(args) - 1}": last, **kwargs})
        assert by_name[-1][0] == (f"p{len(args) - 1}", launch._spec(last))


def test_tensor_descriptors_are_keyed_and_take_the_compiled_launcher(kernel):
    """A host-side TMA descriptor (the fused MoE's weight tiles): the same kind of descriptor
    over other weights is a hit, launched with this call's descriptor; another block shape or
    dtype is another specialization, and another key."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn, runner, _ = kernel
    x = torch.zeros(64)

    def desc(b: torch.Tensor, block: list[int]) -> TensorDescriptor:
        return TensorDescriptor(b, list(b.shape), list(b.stride()), block)

    w1, w2 = torch.zeros(4, 64, 64, dtype=torch.bfloat16), torch.ones(4, 64, 64, dtype=torch.bfloat16)
    d1, d2 = desc(w1, [1, 32, 64]), desc(w2, [1, 32, 64])
    runner[(1,)](x, 64, d1, BLOCK=32)
    runner[(1,)](x, 64, d2, BLOCK=32)
    assert (runner.misses, runner.hits) == (1, 1)
    (compiled,) = fn.compiled.values()
    assert compiled.launches[-1][11] is d2  # this call's descriptor, not the first one's
    others = [desc(w1, [1, 16, 64]), desc(w1.float(), [1, 32, 64])]
    for d in others:
        runner[(1,)](x, 64, d, BLOCK=32)
    assert (runner.misses, runner.hits, len(fn.compiled)) == (3, 1, 3)  # new keys, new specializations
    # another shape over the same block: Triton shares the kernel; the key is finer (a miss)
    runner[(1,)](x, 64, desc(torch.zeros(2, 64, 64, dtype=torch.bfloat16), [1, 32, 64]), BLOCK=32)
    assert runner.misses == 4 and len(fn.compiled) == 3


# --- pinned sites (`launch.site`): a bound forward's launches, checked against one key --------


def _pinned_site(runner: launch.Launcher) -> tuple[launch.Site, torch.Tensor, torch.Tensor]:
    """A site of the stand-in kernel launched twice (Triton's path, then a keyed hit that pins)."""
    x, w = torch.zeros(64), torch.ones(8)
    s = launch.site(runner, (1,), BLOCK=32)
    s(x, 64, w)
    s(x, 64, w)
    return s, x, w


def test_a_site_pins_on_its_second_launch_and_launches_as_the_keyed_path(kernel):
    fn, runner, _ = kernel
    x, w = torch.zeros(64), torch.ones(8)
    s = launch.site(runner, (3,), BLOCK=32)
    for _ in range(4):
        s(x, 64, w)
    # Triton's path, a keyed hit that pins, then two pinned launches
    assert (runner.misses, runner.hits, s.pinned) == (1, 3, 2)
    (compiled,) = fn.compiled.values()
    want = (3, 1, 1, 1000, "cufunction", "meta", None, None, None, x, 64, w, 32, 7)
    assert compiled.launches == [want] * 3


def test_a_site_used_once_costs_no_second_key(kernel, monkeypatch):
    _, runner, _ = kernel
    keys = []
    real = runner._key
    monkeypatch.setattr(runner, "_key", lambda *a: keys.append(1) or real(*a))
    launch.site(runner, (1,), BLOCK=32)(torch.zeros(64), 64, torch.ones(8))
    assert len(keys) == 1


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x, n, w: (x[1:], n, w), id="misaligned-tensor"),
        pytest.param(lambda x, n, w: (x.double(), n, w), id="tensor-dtype"),
        pytest.param(lambda x, n, w: (x, 65, w), id="int-not-multiple-of-16"),
        pytest.param(lambda x, n, w: (x, 1, w), id="int-equal-to-1"),
        pytest.param(lambda x, n, w: (x, 2**40, w), id="int-64-bit"),
        pytest.param(lambda x, n, w: (x, 2**63, w), id="int-unsigned-64-bit"),
        pytest.param(lambda x, n, w: (x, 64.0, w), id="int-to-float"),
        pytest.param(lambda x, n, w: (x, True, w), id="int-to-bool"),
        pytest.param(lambda x, n, w: (x, n, None), id="tensor-to-none"),
        pytest.param(lambda x, n, w: (x, n), id="fewer-arguments"),
    ],
)
def test_a_pinned_site_takes_the_keyed_path_on_every_change_triton_specializes_on(kernel, change):
    fn, runner, _ = kernel
    s, x, w = _pinned_site(runner)
    assert s._pin is not None
    args = change(x, 64, w)
    assert s._pin.prepare(args, True) is None
    if len(args) == 3:  # (a call with an argument missing is Triton's to refuse)
        s(*args)  # Triton's path: a new specialization
        assert s.pinned == 0 and runner.misses == 2 and len(fn.compiled) == 2


def test_a_pinned_site_launches_this_calls_tensors_and_values_triton_does_not_specialize_on(kernel):
    fn, runner, _ = kernel
    s, x, w = _pinned_site(runner)
    x2, w2 = torch.zeros(64), torch.full((8,), 2.0)
    s(x2, 48, w2)  # other tensors, another multiple of 16
    assert s.pinned == 1 and len(fn.compiled) == 1
    assert next(iter(fn.compiled.values())).launches[-1][9:] == (x2, 48, w2, 32, 7)


def test_hooks_disabled_pins_and_the_interpreter_take_the_keyed_or_tritons_path(kernel, monkeypatch):
    fn, runner, runtime = kernel
    x, w = torch.zeros(64), torch.ones(8)
    s = launch.site(runner, (1,), BLOCK=32)
    for _ in range(2):
        s(x, 64, w)
    runtime.launch_enter_hook.calls.append(print)  # a profiler's hook
    s(x, 64, w)
    runtime.launch_enter_hook.calls.clear()
    monkeypatch.setattr(launch, "PINNED", False)
    s(x, 64, w)
    assert s.pinned == 0 and runner.misses == 2 and runner.hits == 2
    monkeypatch.setattr(launch, "PINNED", True)
    s(x, 64, w)
    assert s.pinned == 1
    # a plain `@triton.jit` kernel (the interpreter's): `kernel[grid](*args, **kwargs)` each time
    calls = []

    class Plain:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    plain = launch.site(Plain(), (2,), BLOCK=8)
    plain(x, 1)
    plain(x, 1)
    assert calls == [((2,), (x, 1), {"BLOCK": 8})] * 2


def test_verify_raises_when_a_pinned_kernel_is_not_tritons_choice(kernel, monkeypatch):
    _, runner, _ = kernel
    s, x, w = _pinned_site(runner)
    monkeypatch.setattr(launch, "VERIFY", True)
    s(x, 64, w)  # agrees
    s._pin = launch._Pin(
        *(Compiled(("other",)) if f == "kernel" else getattr(s._pin, f) for f in s._pin.__dataclass_fields__)
    )
    with pytest.raises(RuntimeError, match="another compiled kernel"):
        s(x, 64, w)


@settings(max_examples=200, deadline=None)
@given(first=st.lists(_values, min_size=0, max_size=5), second=st.lists(_values, min_size=0, max_size=5))
def test_a_pins_check_passes_exactly_when_the_key_is_the_same(first, second):
    """The generated check (`Launcher._make_prepare`) is the key's comparison, argument by
    argument: it passes for another call's arguments exactly when that call's key equals the
    pinned one, and then gives the arguments themselves (CPU tensors stay tensors)."""
    params = [Param(f"p{i}") for i in range(5)] + [Param("BLOCK", True)]
    runner = launch.Launcher(FakeJit(params))
    kwargs = {"BLOCK": 16}
    key = runner._key(0, tuple(first), kwargs)
    prepare = runner._make_prepare(tuple(first), key[2 : 2 + len(first)], (16,))
    assert _same(prepare(tuple(first), True), (*first, 16))
    got = prepare(tuple(second), True)
    assert (got is not None) == (runner._key(0, tuple(second), kwargs) == key)
    assert got is None or _same(got, (*second, 16))


def _same(got: tuple[Any, ...] | None, want: tuple[Any, ...]) -> bool:
    return got is not None and len(got) == len(want) and all(g is w or g == w for g, w in zip(got, want, strict=True))


def test_pinning_again_reuses_the_generated_check(kernel):
    """Sites bound anew (another token count, a rebound launch) pin with the check generated for
    the same key entries: a lookup, not a compile; each check still compares its own values."""
    _, runner, _ = kernel
    first, second = launch.site(runner, (1,), BLOCK=32), launch.site(runner, (2,), BLOCK=32)
    x, w = torch.zeros(64), torch.ones(8)
    for s, n in ((first, 64), (second, 32)):
        s(x, n, w)
        s(x, n, w)
    assert len(runner._checks) == 1
    assert first._pin.prepare((x, 64, w), True) is not None and second._pin.prepare((x, 32, w), True) is not None
    assert second._pin.prepare((x, 33, w), True) is None
    second(x, 33, w)  # another key: Triton's path, then its own check
    second(x, 33, w)
    assert len(runner._checks) == 2 and second._pin.prepare((x, 33, w), True) is not None


def test_a_pinned_launch_gives_gpu_tensors_to_the_launcher_as_their_addresses(kernel, monkeypatch):
    """Tensors on the GPU (here: CPU tensors, standing in through `_DEVICE_FLAG`) go to the
    launcher as the addresses the check read; `RAW_POINTERS = False` gives it the tensors. A
    tensor that is not on the GPU where the pinned one was takes the keyed path, whose launcher
    (Triton's) refuses it."""
    monkeypatch.setattr(launch, "_DEVICE_FLAG", "is_cpu")
    fn, runner, _ = kernel
    s, x, w = _pinned_site(runner)
    x2, w2 = torch.zeros(64), torch.full((8,), 2.0)
    s(x2, 48, w2)
    (compiled,) = fn.compiled.values()
    assert compiled.launches[-1][9:] == (x2.data_ptr(), 48, w2.data_ptr(), 32, 7)
    monkeypatch.setattr(launch, "RAW_POINTERS", False)
    s(x2, 48, w2)
    assert compiled.launches[-1][9:] == (x2, 48, w2, 32, 7)
    assert s.pinned == 2
    elsewhere = torch.zeros(64, device="meta")  # not "on the GPU": its address is not device memory
    assert s._pin.prepare((elsewhere, 48, w2), True) is None
    s(elsewhere, 48, w2)
    assert s.pinned == 2 and runner.hits == 4  # the keyed path's hit, with the tensor as it is
    assert compiled.launches[-1][9:] == (elsewhere, 48, w2, 32, 7)
    # pinned on a Tensor subclass (a weight kept as a Parameter): plain tensors still pin and
    # go as addresses; the subclass itself goes as it is (Triton's spec decides for it)
    monkeypatch.setattr(launch, "RAW_POINTERS", True)
    param = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    p = launch.site(runner, (1,), BLOCK=32)
    p(param, 64, w)
    p(param, 64, w)
    p(x2, 64, w2)
    p(param, 64, w2)
    assert p.pinned == 2
    assert compiled.launches[-2][9:] == (x2.data_ptr(), 64, w2.data_ptr(), 32, 7)
    assert compiled.launches[-1][9] is param
