# ruff: noqa: ANN001, ANN201, ANN202  (stand-ins mirror foreign, untyped signatures)
"""Make SGLang 0.5.23's Triton fused MoE importable on the offline GPU machine, for
`moehal bench --backends sglang` (`moehal.integrations.sglang` calls SGLang's own function).

    python3 tools/sglang_peer.py smoke            # SGLang's peer vs an fp32 reference, 3 shapes
    python3 tools/sglang_peer.py bench ARGS...    # `moehal bench ARGS...` with SGLang importable

What is and is not SGLang's own code when this runs (`info()` prints it; keep it with results):
  * SGLang's modules are unmodified. Five package `__init__` files (which would import the
    whole server: transformers model configs, pydantic, zmq, ...) are replaced by lazy shells
    that import a re-exported name on first use; `pydantic_core` and `zmq` get catch-all stubs
    when missing (server utilities only, never on the MoE path).
  * Runtime-config reads on the MoE path (exec/parallel config, symmetric memory) are bound to
    SGLang's defaults instead of publishing a whole ServerArgs.
  * Kernels: SGLang's Triton GEMM kernels and tuned configs; `moe_align_block_size` and
    `moe_sum_reduce` from sgl_kernel (sglang-kernel 0.4.6, the last built for torch 2.11;
    SGLang 0.5.23 pins 0.4.10, built for torch 2.14.1, same op schemas). If sgl_kernel does not
    import, torch stand-ins are used and `info()` says so. `silu_and_mul`: SGLang's JIT CUDA
    kernel (nvcc on first use), else sgl_kernel's, else torch (reported).

Carried files (built by tools/fetch_device_wheels.sh; what ran with them is described in
docs/device-runs/2026-11-22-session2/README.md, "The SGLang peer: exactly what ran"): the sglang
0.5.23 wheel minus its Rust server extensions, sglang-kernel 0.4.6 (python files + the sm90
library), msgspec, orjson, pybase64, starlette.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

ENTRY_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
_LAZY_PKGS = (
    "sglang",  # its __init__ imports the frontend language API, HF patches, ...
    "sglang.srt.configs",  # imports every model config (transformers, torchvision)
    "sglang.srt.layers.moe",
    "sglang.srt.layers.moe.moe_runner",  # runner.py pulls deep_gemm, model_executor, ...
    "sglang.srt.layers.deep_gemm_wrapper",
)
_STUB_IF_MISSING = ("pydantic_core", "zmq")

_INFO: dict = {}
_fm = None  # the entry module once loaded
_MoeRunnerConfig = None
_silu_resolved = False


# ----------------------------------------------------------------------------- stubs
class _AnyObj:
    """Placeholder attribute of a stub module: any attribute/call/base-class use works."""

    def __init__(self, name):
        self._n = name

    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _AnyObj(self._n + "." + k)

    def __call__(self, *a, **k):
        return _AnyObj(self._n + "()")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<peer stub {self._n}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__") and k.endswith("__"):
            raise AttributeError(k)
        v = _AnyObj(f"{self.__name__}.{k}")
        setattr(self, k, v)
        return v


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__peer_stub__ = True
        return m

    def exec_module(self, m):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


def _lazy_pkg(pkg: str, root: str) -> None:
    """Register `pkg` as a package whose __init__ is not run; names it re-exports are
    imported from their defining module on first attribute access."""
    if pkg in sys.modules:
        return
    base = os.path.join(root, *pkg.split(".")[1:])
    init = os.path.join(base, "__init__.py")
    names = {}
    if os.path.exists(init):
        with open(init) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.level:
                    anchor = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    mod = anchor + "." + node.module
                else:
                    mod = node.module
                for a in node.names:
                    names[a.asname or a.name] = (mod, a.name)
    m = types.ModuleType(pkg)
    m.__path__ = [base]
    m.__package__ = pkg
    m.__file__ = init
    m.__peer_lazy__ = True

    def __getattr__(name, _names=names, _pkg=pkg):
        if name in _names:
            mod, attr = _names[name]
            v = getattr(importlib.import_module(mod), attr)
            setattr(sys.modules[_pkg], name, v)
            return v
        raise AttributeError(f"module {_pkg!r} (peer lazy shell) has no attribute {name!r}")

    m.__getattr__ = __getattr__
    sys.modules[pkg] = m


# ------------------------------------------------------------------ fallback kernels
def _torch_moe_align_block_size(
    topk_ids,
    num_experts,
    block_size,
    sorted_token_ids,
    experts_ids,
    num_tokens_post_pad,
    cumsum_buffer,
    pad_sorted_token_ids=False,
    ignore_invalid_expert=False,
):
    """Same contract as sgl_kernel.moe_align_block_size with SGLang's '+1 bucket' call
    (num_experts = E + 1, bucket 0 holds expert id -1).  Device-side only, no host sync."""
    import torch

    numel = topk_ids.numel()
    nb = num_experts
    bucket = topk_ids.reshape(-1).to(torch.int64) + 1
    counts = torch.bincount(bucket, minlength=nb)[:nb]
    padded = (counts + block_size - 1) // block_size * block_size
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    ustart = torch.cumsum(counts, 0) - counts
    order = torch.argsort(bucket, stable=True)
    sb = bucket[order]
    pos = pstart[sb] + (torch.arange(numel, device=bucket.device) - ustart[sb])
    sorted_token_ids.fill_(numel)
    sorted_token_ids[pos] = order.to(sorted_token_ids.dtype)
    nblk = experts_ids.numel()
    starts = torch.arange(nblk, device=bucket.device, dtype=torch.int64) * block_size
    blk_bucket = torch.searchsorted(pend, starts, right=True).clamp_(max=nb - 1)
    ids = torch.where(starts >= pend[-1], torch.full_like(blk_bucket, -1), blk_bucket - 1)
    experts_ids.copy_(ids.to(experts_ids.dtype))
    num_tokens_post_pad[:1].copy_(pend[-1:].to(num_tokens_post_pad.dtype))
    cumsum_buffer[0] = 0
    cumsum_buffer[1 : nb + 1].copy_(pend.to(cumsum_buffer.dtype))


def _torch_silu_and_mul(input, out=None, *args, **kwargs):
    import torch.nn.functional as F

    d = input.shape[-1] // 2
    r = F.silu(input[..., :d]) * input[..., d:]
    if out is None:
        return r
    out.copy_(r)
    return out


def _stub_sgl_kernel_moe_sum_reduce(input, output, routed_scaling_factor=0.0):
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

    moe_sum_reduce_triton(input, output, routed_scaling_factor)


def _make_sgl_kernel_stub() -> types.ModuleType:
    m = types.ModuleType("sgl_kernel")
    m.__peer_stub__ = True
    m.moe_align_block_size = _torch_moe_align_block_size
    m.moe_sum_reduce = _stub_sgl_kernel_moe_sum_reduce
    m.silu_and_mul = lambda input, out=None: _torch_silu_and_mul(input, out)

    def __getattr__(name):
        raise AttributeError(f"sgl_kernel.{name} is not available (peer stub)")

    m.__getattr__ = __getattr__
    return m


# ------------------------------------------------------------------------- setup
def _find_sglang_root() -> str:
    spec = importlib.util.find_spec("sglang")  # does not execute sglang/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "sglang is not on sys.path (install the wheel with --target and "
            "put that directory on PYTHONPATH, or set SGL_PEER_SITE)"
        )
    return list(spec.submodule_search_locations)[0]


def _load():
    global _fm, _MoeRunnerConfig
    if _fm is not None:
        return _fm
    site = os.environ.get("SGL_PEER_SITE")
    if site and site not in sys.path:
        sys.path.insert(0, site)

    # A full SGLang install imports transformers, whose logging module adds
    # `Logger.warning_once`; SGLang's MoE code calls it (e.g. when a tuned config enables TMA).
    import functools
    import logging

    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)
        _INFO["logger_warning_once"] = "added (transformers would)"

    missing = [n for n in _STUB_IF_MISSING if importlib.util.find_spec(n) is None]
    if missing:
        sys.meta_path.append(_StubFinder(missing))
    _INFO["stubbed_modules"] = missing

    try:
        import sgl_kernel  # noqa: F401

        _INFO["sgl_kernel"] = getattr(sgl_kernel, "__version__", "?")
    except Exception as e:  # absent, or built against another torch (undefined symbol)
        sys.modules.pop("sgl_kernel", None)
        sys.modules["sgl_kernel"] = _make_sgl_kernel_stub()
        _INFO["sgl_kernel"] = f"stub ({type(e).__name__}: {str(e)[:120]})"

    if "sglang" not in sys.modules:
        root = _find_sglang_root()
        for p in _LAZY_PKGS:
            _lazy_pkg(p, root)
        _INFO["lazy_packages"] = list(_LAZY_PKGS)

    fm = importlib.import_module(ENTRY_MODULE)
    cfgmod = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    # Runtime-config reads on this path, bound to their defaults (no ServerArgs published).
    exec_bag = types.SimpleNamespace(
        moe=types.SimpleNamespace(enable_fused_moe_sum_all_reduce=False),
        deterministic=types.SimpleNamespace(enable_deterministic_inference=False),
    )
    fm.get_exec = lambda: exec_bag
    cfgmod.get_exec = lambda: exec_bag
    fm.get_parallel = lambda: types.SimpleNamespace(tp_group=None)
    fm.is_allocation_symmetric = lambda: False
    fm.use_symmetric_memory = lambda *a, **k: contextlib.nullcontext()

    _INFO["moe_align"] = (
        "sgl_kernel AOT" if not getattr(sys.modules["sgl_kernel"], "__peer_stub__", False) else "torch fallback"
    ) + " (Triton moe_align_small_numel when T*K<=64 and E>=64)"
    _INFO["moe_sum_reduce"] = (
        "sgl_kernel AOT"
        if not getattr(sys.modules["sgl_kernel"], "__peer_stub__", False)
        else "SGLang moe_sum_reduce_triton"
    ) + " for T>32 and K>2; SGLang Triton for T<=32 (sm90); torch.add for K==2"
    _fm, _MoeRunnerConfig = fm, MoeRunnerConfig
    return fm


def _resolve_silu(device) -> None:
    """Pick silu_and_mul once, on the first call (JIT compile needs the GPU and nvcc)."""
    global _silu_resolved
    if _silu_resolved:
        return
    import torch

    fm = _fm
    want = os.environ.get("SGL_PEER_SILU", "auto")
    sk = sys.modules.get("sgl_kernel")
    have_aot = sk is not None and not getattr(sk, "__peer_stub__", False)

    def aot(input, out=None, *args, **kwargs):  # row filter kwargs are an optimisation only
        return sk.silu_and_mul(input, out)

    chosen, err = None, None
    if want in ("auto", "jit") and getattr(fm, "_is_cuda", False) and hasattr(fm, "silu_and_mul"):
        try:
            x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
            y = torch.empty(4, 128, device=device, dtype=torch.bfloat16)
            fm.silu_and_mul(x, y)
            torch.cuda.synchronize(device)
            if not torch.allclose(y.float(), _torch_silu_and_mul(x).float(), atol=2e-2, rtol=2e-2):
                raise RuntimeError("JIT silu_and_mul mismatch")
            chosen = "SGLang JIT (tvm-ffi) silu_and_mul"
        except Exception as e:  # no nvcc / tvm_ffi / headers
            err = f"{type(e).__name__}: {str(e)[:160]}"
            if want == "jit":
                raise
    if chosen is None and want in ("auto", "aot") and have_aot:
        fm.silu_and_mul = aot
        chosen = "sgl_kernel AOT silu_and_mul"
    if chosen is None:
        fm.silu_and_mul = _torch_silu_and_mul
        chosen = "torch silu*mul"
    _INFO["silu_and_mul"] = chosen + (f" (JIT failed: {err})" if err else "")
    _silu_resolved = True


def fused_moe(hidden, w13, w2, topk_ids, topk_weights, *, inplace: bool = False, num_global_experts: int | None = None):
    """SGLang fused_experts, BF16, SiLU-and-mul.  Returns [T, H].

    num_global_experts: set (e.g. 256) for an EP slice whose topk_ids use -1 for experts
    not on this rank; SGLang then runs with filter_expert=True.  Default: all local."""
    fm = _load()
    _resolve_silu(hidden.device)
    E = w13.shape[0]
    cfg = _MoeRunnerConfig(
        num_experts=num_global_experts or E,
        num_local_experts=E,
        activation="silu",
        is_gated=True,
        inplace=inplace,
    )
    return fm.fused_experts(hidden, w13, w2, (topk_weights, topk_ids, None), cfg)


def config_for(e: int, i: int, m: int, top_k: int, h: int):
    """The (up, down) Triton configs SGLang picks for these shapes on this GPU."""
    fm = _load()
    return fm.try_get_optimal_moe_config((e, 2 * i, h), (e, h, i), top_k, None, m, return_down_config=True)


def info() -> dict:
    return dict(_INFO)


def smoke() -> None:
    """SGLang's fused experts against an fp32 reference at the three benchmark shapes (64 tokens)."""
    import torch

    torch.manual_seed(0)
    dev = "cuda"
    for e, h, i, k, t in [(128, 2048, 768, 8, 64), (8, 4096, 14336, 2, 64), (32, 7168, 2048, 8, 64)]:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) / i**0.5
        tw, ti = torch.topk(torch.softmax(torch.randn(t, e, device=dev), -1), k, dim=-1)
        ti = ti.to(torch.int32)
        with torch.inference_mode():
            out = fused_moe(x, w13, w2, ti, tw.float())
            ref = torch.zeros(t, h, device=dev, dtype=torch.float32)
            for ex in ti.unique().tolist():
                tok, slot = (ti == ex).nonzero(as_tuple=True)
                g = x[tok].float() @ w13[ex].float().t()
                a = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
                ref.index_add_(0, tok, tw[tok, slot, None] * (a @ w2[ex].float().t()))
        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        print(f"E={e} H={h} I={i} K={k} T={t}: rel max err {err:.3e}")
    print(info())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        import torch

        _load()
        _resolve_silu(torch.device("cuda"))
        print("sglang peer:", info(), flush=True)
        from moehal.bench import main

        sys.exit(main(sys.argv[2:]))
    smoke()
