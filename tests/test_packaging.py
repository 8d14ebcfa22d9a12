"""The wheel's package list against the source folders. Folders map onto other import names
(`core/` is `moehal`), so the editable install imports a subpackage that `[tool.setuptools]
packages` does not list, and CI passes while the wheel leaves it out. Every folder under a
mapped package that holds Python modules or data files must be listed."""

from __future__ import annotations

from pathlib import Path

import pytest

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
