"""What hardware a layer will run on. Detection never imports a vendor extension."""

from __future__ import annotations

import importlib.util
import platform
import re
from dataclasses import dataclass

import torch
from moehal.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HardwareInfo:
    """kind: 'cpu', 'cuda' (NVIDIA), 'rocm' (AMD through torch.cuda), 'npu' (Ascend) or another
    torch device type; capability: (major, minor) for CUDA (e.g. (9, 0) for Hopper) and
    ROCm (gfx arch as reported by torch), else None."""

    kind: str
    device: torch.device
    name: str
    capability: tuple[int, int] | None = None
    arch: str | None = None  # e.g. 'gfx942' on ROCm

    @property
    def sm(self) -> int | None:
        """CUDA compute capability as an int (90, 100, ...); None elsewhere."""
        if self.kind != "cuda" or self.capability is None:
            return None
        return self.capability[0] * 10 + self.capability[1]

    def describe(self) -> str:
        extra = f" sm{self.sm}" if self.sm else (f" {self.arch}" if self.arch else "")
        return f"{self.kind}:{self.device.index if self.device.index is not None else 0} {self.name}{extra}"


def default_device() -> torch.device:
    """The best device torch sees: cuda (NVIDIA or ROCm), then npu if torch_npu is already
    imported by the application, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if npu is not None and callable(getattr(npu, "is_available", None)) and npu.is_available():
        return torch.device("npu", 0)
    return torch.device("cpu")


def detect(device: torch.device | str | None = None) -> HardwareInfo:
    """The hardware behind `device` (default: `default_device()`).

    Raises ConfigError where `device` is no device torch knows (e.g. 'npu' before `import
    torch_npu`) or names one this machine lacks (`cuda` on a CPU-only torch build or with no GPU
    visible, an index past the last GPU), saying what to do instead.
    """
    dev = as_device(device) if device is not None else default_device()
    if dev.type == "cpu":
        return HardwareInfo("cpu", dev, platform.processor() or platform.machine() or "cpu")
    if dev.type == "cuda":
        try:
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
        except (AssertionError, RuntimeError) as exc:  # torch's "not compiled with CUDA", "invalid device id"
            raise ConfigError(_no_cuda_device(dev, exc)) from exc
        if torch.version.hip is not None:
            arch = getattr(props, "gcnArchName", "").split(":")[0] or None
            return HardwareInfo("rocm", torch.device("cuda", idx), props.name, (props.major, props.minor), arch)
        return HardwareInfo("cuda", torch.device("cuda", idx), props.name, (props.major, props.minor))
    if dev.type == "npu":
        name = "Ascend NPU"
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "get_device_name"):
            try:
                name = npu.get_device_name(dev.index or 0)
            except (AssertionError, RuntimeError) as exc:
                raise ConfigError(
                    f"device {str(dev)!r} asked for, but torch_npu cannot query it ({type(exc).__name__}: {exc}): "
                    "check the Ascend driver (npu-smi info) and ASCEND_RT_VISIBLE_DEVICES, or pass device='cpu'"
                ) from exc
        return HardwareInfo("npu", dev, name)
    return HardwareInfo(dev.type, dev, dev.type)


def as_device(device: torch.device | str) -> torch.device:
    """`torch.device(device)`; a string torch does not know as a device is a ConfigError."""
    try:
        return torch.device(device)
    except RuntimeError as exc:
        if str(device).split(":")[0] == "npu":
            raise ConfigError(
                f"device {str(device)!r} asked for, but torch {torch.__version__} knows no 'npu' device: "
                "`import torch_npu` first (Ascend), or pass device='cpu'"
            ) from exc
        raise ConfigError(f"{device!r} is not a torch device: {exc}") from exc


def _no_cuda_device(dev: torch.device, exc: BaseException) -> str:
    """Why `dev` (a cuda device) cannot be used here, and what to do."""
    want = f"device {str(dev)!r} asked for, but"
    if torch.version.cuda is None and torch.version.hip is None:
        return (
            f"{want} torch {torch.__version__} is a CPU-only build (no CUDA or ROCm): install a CUDA or ROCm "
            "build of torch, or pass device='cpu'"
        )
    try:
        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - only for the message
        count = 0
    if count == 0:
        runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
        return (
            f"{want} torch {torch.__version__} ({runtime}) sees no GPU: check the driver (nvidia-smi / "
            "rocm-smi) and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or pass device='cpu'"
        )
    if dev.index is not None and not 0 <= dev.index < count:
        return f"{want} only {count} GPU(s) are visible (cuda:0 .. cuda:{count - 1})"
    return f"{want} torch could not query it: {type(exc).__name__}: {exc}"


def module_available(name: str) -> bool:
    """Whether a module could be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def package_version(dist: str) -> str | None:
    """Installed version of a distribution, or None."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_slug(name: str) -> str:
    """A device name as a file-name part: lower case, [a-z0-9] and '_' (tuned-table files)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
