"""The wheel's package list against the source folders. Folders map onto other import names
(`core/` is `moehal`), so the editable install imports a subpackage that `[tool.setuptools]
packages` does not list, and CI passes while the wheel leaves it out. Every folder under a
mapped package that holds Python modules or data files must be listed.

And the extras against pyproject's promise that no extra pins, upgrades or replaces torch."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_in_the_wheel():
    cfg = _setuptools()
    listed = set(cfg["packages"])
    missing = []
    for top, folder in cfg["package-dir"].items():
        base = ROOT / folder
        for d in [base, *sorted(p for p in base.rglob("*") if p.is_dir())]:
            if d.name == "__pycache__" or any(part == "__pycache__" for part in d.parts):
                continue
            if not any(f.suffix in (".py", ".json") for f in d.iterdir() if f.is_file()):
                continue
            name = ".".join([top, *d.relative_to(base).parts])
            if name not in listed:
                missing.append(f"{name} ({d.relative_to(ROOT)})")
    assert not missing, f"folders the wheel would leave out; add them to [tool.setuptools] packages: {missing}"


def test_every_listed_package_has_a_folder_and_the_license_ships():
    cfg = _setuptools()
    for name in cfg["packages"]:
        top, *rest = name.split(".")
        assert (ROOT / cfg["package-dir"][top] / Path(*rest)).is_dir(), name
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "include LICENSE" in manifest and "graft tests" in manifest


# The triton that torch's own wheels pin (PyPI, Linux x86_64), read from their metadata
# (`pip install --dry-run --no-deps --report`) on 2026-11-29. An extra's triton requirement must
# admit each: one that excludes a torch's pin makes pip fail, or replace that torch.
TORCH_PINS_TRITON = {"2.6": "3.2.0", "2.11": "3.6.0", "2.12": "3.7.0", "2.13": "3.7.1", "2.14": "3.8.0"}
# Distributions that are torch, or pin one: torch-npu releases require the torch of their number.
TORCH_STACK = {"torch", "torch-npu", "pytorch-triton-rocm", "torchvision", "torchaudio"}


def _requirements(extra: str, extras: dict[str, list[str]]) -> list[Requirement]:
    """An extra's requirements, with moehal's own extras it names (`moehal[test,docs]`) expanded."""
    out = []
    for text in extras[extra]:
        req = Requirement(text)
        if canonicalize_name(req.name) == "moehal":
            for inner in sorted(req.extras):
                out += _requirements(inner, extras)
        else:
            out.append(req)
    return out


def test_no_extra_installs_upgrades_or_replaces_torch():
    """pyproject promises that no extra pins torch and that an extra never upgrades it. The `npu`
    extra required `torch-npu>=2.6`: pip took the newest torch-npu and installed the torch it
    pins over the user's (torch 2.13 replaced by 2.14). The `test` extra required `triton>=3.9`,
    which no CUDA torch up to 2.14 admits: `pip install "torch==2.13.0" -e ".[test]"`, the
    README's own command, failed to resolve on PyPI (security review 2026-11-29, finding 5)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    floor = min((s.version for s in torch_req.specifier if s.operator == ">="), key=Version)
    assert floor in TORCH_PINS_TRITON, f"torch's floor moved to {floor}: add the triton its wheels pin"
    for extra in extras:
        for req in _requirements(extra, extras):
            name = canonicalize_name(req.name)
            assert name not in TORCH_STACK, f"extra {extra!r} requires {req}: it would install or replace torch"
            if name == "triton":
                refused = [f"torch {t} pins {v}" for t, v in TORCH_PINS_TRITON.items() if v not in req.specifier]
                assert not refused, f"extra {extra!r} requires {req}, which excludes what torch pins: {refused}"
    assert extras["npu"] == [] and extras["rocm"] == [], "libraries tied to a torch release are installed by hand"
