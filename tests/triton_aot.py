"""Compile the Triton kernels that a piece of host code launches, for GPUs this machine does not
have (no assertions here; the tests that call it assert).

Why: CI runs the kernels in Triton's interpreter, which accepts code that the compiler refuses
(session 8 met one: a name reused in two branches broke 11 GPU tests). Triton's AOT compiler
needs no GPU. So a child process, without TRITON_INTERPRET (the wrappers then pick the tiles they
pick on a GPU), runs the host code with `JITFunction.run` replaced by a recorder: nothing is
launched, and every launch's arguments are kept. Each distinct specialization is then compiled
for each target. Compiling is not running: it says nothing of results or speed.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parent

TARGETS = {  # name -> (backend, arch, warp size, the binary that must come out)
    "sm90": ("cuda", 90, 32, "cubin"),
    "gfx942": ("hip", "gfx942", 64, "hsaco"),
}


def _type_name(value: Any) -> str:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):  # a host-side TMA descriptor: dtype and block shape
        return f"tensordesc<{_type_name(value.base)[1:]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        names = {
            torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
            torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
            torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8",
            torch.float8_e5m2: "fp8e5",
        }  # fmt: skip
        return "*" + names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record(drive: Callable[[], Any]) -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Run `drive()` with every Triton launch recorded instead of run: one (kernel, signature,
    constexprs, options) per distinct specialization, in launch order."""
    from triton.runtime.jit import JITFunction

    seen: dict[str, tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]] = {}
    original = JITFunction.run

    def fake_run(self: JITFunction, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> None:
        names = [p.name for p in self.params]
        options = {key: kwargs.pop(key) for key in list(kwargs) if key not in names}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        sig: dict[str, str] = {}
        consts: dict[str, Any] = {}
        for p in self.params:
            value = bound.arguments[p.name]
            if p.is_constexpr or value is None:
                sig[p.name], consts[p.name] = "constexpr", value
            else:
                sig[p.name] = _type_name(value)
        key = repr((self.fn.__module__, self.fn.__qualname__, sig, consts, options))
        seen.setdefault(key, (self, sig, consts, options))

    JITFunction.run = fake_run  # type: ignore[method-assign]
    try:
        drive()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return list(seen.values())


def compile_for(
    launches: Sequence[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]], target_name: str
) -> list[str]:
    """Compile each launch for the target; returns the names compiled (raises on the first failure,
    naming the kernel and its constexprs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp, binary = TARGETS[target_name]
    target = GPUTarget(backend, arch, warp)
    done = []
    for fn, sig, consts, options in launches:
        opts = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "num_ctas")}
        try:
            out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=opts)
        except Exception as exc:
            raise RuntimeError(f"{fn.fn.__name__} {consts} {opts} does not compile for {target_name}: {exc}") from exc
        if binary not in out.asm:
            raise RuntimeError(f"{fn.fn.__name__}: no {binary} for {target_name}")
        name = fn.fn.__name__
        if any(v.startswith("tensordesc") for v in sig.values()):
            # A host-side descriptor argument: on NVIDIA it must have become TMA copies.
            if backend == "cuda" and "cp.async.bulk.tensor" not in out.asm["ptx"]:
                raise RuntimeError(f"{name} {consts}: a tensor descriptor, but no TMA copy in the PTX")
            name += "[tensordesc]"
        done.append(name)
    return done


def check_in_child(test_file: str, drive_name: str, targets: Sequence[str], cache_dir: str) -> str:
    """Record `drive_name()` from `test_file` and compile its launches for `targets`, in a child
    process without TRITON_INTERPRET. Returns the child's report; raises with its stderr."""
    code = (
        "import sys, importlib.util\n"
        f"sys.path[:0] = [{str(_TESTS)!r}, {str(Path(test_file).parent)!r}]\n"
        "import triton_aot\n"
        f"spec = importlib.util.spec_from_file_location('aot_drive', {test_file!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"launches = triton_aot.record(mod.{drive_name})\n"
        f"for t in {list(targets)!r}:\n"
        "    names = triton_aot.compile_for(launches, t)\n"
        "    print(t, len(names), ' '.join(sorted(set(names))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache_dir  # a fresh cache: really compile
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise AssertionError(r.stderr[-4000:])
    return r.stdout
