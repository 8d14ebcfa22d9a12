"""What hardware a layer will run on. Detection never imports a vendor extension."""

from __future__ import annotations

import importlib.util
import platform
import re
from dataclasses import dataclass

import torch


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
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cpu":
        return HardwareInfo("cpu", dev, platform.processor() or platform.machine() or "cpu")
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        if torch.version.hip is not None:
            arch = getattr(props, "gcnArchName", "").split(":")[0] or None
            return HardwareInfo("rocm", torch.device("cuda", idx), props.name, (props.major, props.minor), arch)
        return HardwareInfo("cuda", torch.device("cuda", idx), props.name, (props.major, props.minor))
    if dev.type == "npu":
        name = "Ascend NPU"
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "get_device_name"):
            name = npu.get_device_name(dev.index or 0)
        return HardwareInfo("npu", dev, name)
    return HardwareInfo(dev.type, dev, dev.type)


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
