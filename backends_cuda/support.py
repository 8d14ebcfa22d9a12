"""Shared checks: hardware, library versions, the Triton interpreter. Never imports a vendor
library at module import."""

from __future__ import annotations

import threading
from typing import Any

from moehal.capability import Decision, accept, decline
from moehal.errors import NotSupportedError
from moehal.hardware import module_available, package_version
from moehal.interfaces import BuildRequest
from moehal.kernels.host import (
    interpreter_mode_changed,
    interpreter_too_old,
    interpreting,
    kernels_interpreted,
    mode_change_reason,
)
from packaging.version import InvalidVersion, Version

# sgl-deep-gemm builds are tied to a torch release; 0.1.4.post1 (+ apache-tvm-ffi 0.1.11) is the
# one verified with torch 2.11 + CUDA 13.0 (see docs/backends/cuda.md).
DEEPGEMM_MIN = (0, 1, 4)
FLASHINFER_MIN = (0, 5, 0)
# trtllm-gen FP8/FP4 MoE accept bf16 routing logits for DeepSeek-V3 routing from 0.6.8 (earlier:
# fp32 only; sglang PR #25189 drops its fp32 upcast on that basis)
FLASHINFER_BF16_LOGITS = (0, 6, 8)
# trtllm-gen's softmax routings from the routing refactor (flashinfer PR #2803, in 0.6.8). Before
# it, RoutingMethodType.Default (softmax, no renormalization) had no branch in the routing runner
# and raised "Unimplemented routing method" (flashinfer PR #2889, "Bug A"), and Renormalize chose
# other experts than a float32 softmax when every logit was negative (flashinfer issue #2822;
# vLLM PR #37605 turned the path off for it, PR #38859 back on for the fixed releases).
FLASHINFER_SOFTMAX_ROUTING = (0, 6, 8)


def release_of(text: str | None) -> Version | None:
    """The installed release as PEP 440 orders it, None when unknown or unreadable. A
    pre-release sorts before its release (0.6.8rc1 < 0.6.8: a gate on 0.6.8 turns it away, as
    a feature merged for 0.6.8 may be missing from its candidates); a local tag (+cu130) is
    ignored. (Reading digits alone took 0.6.7rc2 for 0.6.72, past every 0.6.8 gate.)"""
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def at_least(text: str | None, minimum: tuple[int, ...]) -> bool:
    """Whether the release `text` is `minimum` or later; False when it is unknown or unreadable."""
    v = release_of(text)
    return v is not None and v >= Version(".".join(map(str, minimum)))


def older_than(text: str, minimum: tuple[int, ...]) -> str:
    """Why `text` fails a gate on `minimum`, for a decline's reason."""
    want = ".".join(map(str, minimum))
    if release_of(text) is None:
        return f"is not a version moehal can read (PEP 440); {want} or later is needed"
    return f"is older than {want} (a pre-release counts as older than its release)"


def interpreted_mode(req: BuildRequest) -> str:
    # TRITON_INTERPRET on a GPU host interprets the kernels there too: reported as such
    return "interpreted" if kernels_interpreted() else "native"


def cuda_or_interpreter(req: BuildRequest) -> Decision:
    kind = req.hardware.kind
    if interpreter_mode_changed():
        return decline(mode_change_reason(), "hardware")
    if kind == "cuda":
        return accept(predicate="hardware")
    if kind == "cpu" and interpreting():
        old = interpreter_too_old()
        if old is not None:
            return decline(old, "hardware")
        return accept("runs under the Triton interpreter (TRITON_INTERPRET=1)", "hardware")
    if kind == "cpu":
        return decline("no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels interpreted)", "hardware")
    return decline(f"runs on NVIDIA CUDA devices, not {kind}", "hardware")


def sm_decision(req: BuildRequest, allowed: tuple[int, ...], what: str) -> Decision:
    hw = req.hardware
    if hw.kind != "cuda":
        return decline(f"{what} needs an NVIDIA GPU; this device is {hw.kind}", "hardware")
    sm = hw.sm
    if sm not in allowed:
        names = {90: "SM90 (Hopper)", 100: "SM100 (Blackwell)", 103: "SM103 (Blackwell Ultra)"}
        want = " or ".join(names.get(a, f"sm{a}") for a in allowed)
        return decline(f"{what} needs {want}; this device is sm{sm}", "hardware")
    return accept(predicate="hardware")


def triton_decision() -> Decision:
    if not module_available("triton"):
        return decline("triton is not installed (pip install 'moehal[cuda]')", "libraries")
    return accept(predicate="libraries")


_DG: dict[str, Any] = {}


def import_deep_gemm() -> Any:
    """Import deep_gemm once; raises ImportError with the reason."""
    if "mod" not in _DG:
        try:
            import deep_gemm

            _DG["mod"] = deep_gemm
        except Exception as exc:  # noqa: BLE001 - a JIT library may fail in many ways at import
            _DG["err"] = f"{type(exc).__name__}: {exc}"  # before "mod": another thread reads it once "mod" is set
            _DG["mod"] = None
    if _DG["mod"] is None:
        raise ImportError(_DG["err"])
    return _DG["mod"]


def deep_gemm_decision(needed: tuple[str, ...]) -> Decision:
    if not module_available("deep_gemm"):
        return decline("deep_gemm is not installed (pip install sgl-deep-gemm; see docs/backends/cuda.md)", "libraries")
    version = package_version("sgl-deep-gemm") or package_version("deep-gemm") or package_version("deep_gemm")
    if version is not None and not at_least(version, DEEPGEMM_MIN):
        return decline(f"deep_gemm {version} {older_than(version, DEEPGEMM_MIN)}", "libraries")
    try:
        dg = import_deep_gemm()
    except ImportError as exc:
        return decline(f"deep_gemm failed to import: {exc}", "libraries")
    missing = [n for n in needed if not any(hasattr(dg, alias) for alias in n.split("|"))]
    if missing:
        return decline(f"deep_gemm {version} lacks {missing} (API changed between releases)", "libraries")
    return accept(f"deep_gemm {version}", "libraries")


# The GPU whose layers run DeepGEMM in this process: the first one a DeepGEMM layer was built on.
# sgl-deep-gemm 0.1.4 keeps one JIT kernel cache per process, and loads each kernel into the
# context of the GPU that ran it first. The same kernel called on another GPU failed with
# CUDA_ERROR_INVALID_HANDLE (two H200s, docs/device-runs/2026-11-26-session38).
_DG_DEVICE: dict[str, int] = {}


def deep_gemm_device_decision(req: BuildRequest) -> Decision:
    """Accept the GPU that DeepGEMM's kernels in this process are loaded on (or any, before
    the first DeepGEMM layer); decline the others with the reason."""
    first, index = _DG_DEVICE.get("index"), req.hardware.device.index
    if first is None or index is None or first == index:
        return accept(predicate="hardware")
    return decline(
        f"DeepGEMM's kernels in this process are loaded on cuda:{first}, where its first layer was built; "
        f"DeepGEMM keeps one kernel cache per process, and its kernels fail on cuda:{index} "
        "(CUDA_ERROR_INVALID_HANDLE). Run one process per GPU to use DeepGEMM on each",
        "hardware",
    )


_DG_DEVICE_LOCK = threading.Lock()


def claim_deep_gemm_device(req: BuildRequest) -> None:
    """Record the GPU of the first DeepGEMM layer built in this process. Selection checked it
    (`deep_gemm_device_decision`) without holding it: two threads building their first layers
    on two GPUs at once both passed, and one would have run kernels loaded on the other GPU.
    The claim is made under a lock, and the layer that lost the race is refused here."""
    index = req.hardware.device.index
    if req.hardware.kind != "cuda" or index is None:
        return
    with _DG_DEVICE_LOCK:
        first = _DG_DEVICE.setdefault("index", index)
    if first != index:
        raise NotSupportedError(
            f"DeepGEMM's kernels in this process were claimed for cuda:{first} by a layer built at the same "
            f"time as this one on cuda:{index}; DeepGEMM keeps one kernel cache per process. Build this "
            "layer again (selection now declines DeepGEMM here), or run one process per GPU"
        )


def dg_fn(dg: Any, names: str) -> Any:
    """First attribute of `names` ('a|b|c') that deep_gemm has."""
    for n in names.split("|"):
        f = getattr(dg, n, None)
        if f is not None:
            return f
    raise AttributeError(f"deep_gemm has none of {names}")
