"""Developer tools under tools/ that touch files a run did not make itself (security review,
findings 4 and 6): the devpath shim's folder, and the probes' saved `case.pt` files."""

from __future__ import annotations

import os
import pickle
import runpy
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAVED_CASE = ROOT / "docs/device-runs/2026-11-28-session48/h200/call1/case.pt"  # tools/fp8_one_token_probe.py's

needs_git = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None, reason="needs git, bash")


def _source_devpath(repo: Path) -> subprocess.CompletedProcess[str]:
    """`source tools/devpath.sh` in a fresh git checkout `repo`; prints PYTHONPATH after it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = '. tools/devpath.sh; rc=$?; printf "rc=%s\\nPYTHONPATH=%s\\n" "$rc" "$PYTHONPATH"'
    return subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, check=True)


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools/devpath.sh", repo / "tools/devpath.sh")
    (repo / "core").mkdir()
    (repo / "core/__init__.py").write_text("MARK = 'this checkout'\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return repo


@needs_git
def test_devpath_puts_a_private_folder_of_this_checkout_first_on_pythonpath(checkout):
    """It was `/tmp/moehal-devpath-<checkout name>`: another local user could make that folder
    first and drop a sitecustomize.py into it, run by every Python started from the shell."""
    got = _source_devpath(checkout)
    assert "rc=0" in got.stdout, got
    first = Path(got.stdout.split("PYTHONPATH=")[1].strip().split(":")[0])
    assert first.resolve().is_relative_to((checkout / ".git").resolve()), first
    info = first.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert os.readlink(first / "moehal") == str(checkout / "core")
    env = {**os.environ, "PYTHONPATH": str(first)}
    mark = subprocess.run(
        [sys.executable, "-c", "import moehal; print(moehal.MARK)"], env=env, capture_output=True, text=True
    )
    assert mark.stdout.strip() == "this checkout", mark.stderr


@needs_git
def test_devpath_refuses_a_folder_planted_as_a_link(checkout, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "sitecustomize.py").write_text("print('planted')\n")
    (checkout / ".git/moehal-devpath").symlink_to(elsewhere)
    got = _source_devpath(checkout)
    assert "rc=1" in got.stdout and "PYTHONPATH=\n" in got.stdout and "not a folder of yours" in got.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["sitecustomize.py"]  # no links made there


class _RunsCode:
    """A pickle that runs code when loaded with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize("tool", ["fp8_one_token_probe.py", "nvfp4_rounding_probe.py"])
def test_the_probes_load_case_files_without_running_pickled_code(tool, tmp_path, monkeypatch):
    """A `case.pt` comes back from a remote device run; `weights_only=False` ran any code a
    tampered one held, on the developer's machine."""
    marker = tmp_path / "ran"
    evil = tmp_path / "case.pt"
    torch.save({"case": _RunsCode(marker)}, evil)
    monkeypatch.setattr(sys, "argv", [tool, "--load", str(evil), *(["--out", str(tmp_path)] if "fp8" in tool else [])])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tools put tests/ first
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        runpy.run_path(str(ROOT / "tools" / tool), run_name="__main__")
    assert not marker.exists()


def test_the_committed_case_file_loads_with_weights_only():
    saved = torch.load(SAVED_CASE, weights_only=True)
    assert saved["case"]["quant"] == "fp8_block" and saved["device_name"] == "NVIDIA H200"
    assert {"x", "ids", "wts", "out", "want", "loop"} <= set(saved)
    assert all(isinstance(saved[k], torch.Tensor) for k in ("x", "ids", "wts", "out", "want", "loop"))
    assert set(saved["weights"]) >= {"w13", "w2"} and all(
        isinstance(t, torch.Tensor) for t in saved["weights"].values()
    )


@pytest.fixture
def use_source_tree(tmp_path, monkeypatch):
    """tools/ep_gpu_check.py's `_use_source_tree`, its temp folder in tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    link_dir = tmp_path / f"moehal-devpath-{ROOT.name}-{os.getuid()}"
    return runpy.run_path(str(ROOT / "tools/ep_gpu_check.py"))["_use_source_tree"], link_dir


def test_ep_gpu_check_links_the_checkout_in_a_private_folder(use_source_tree):
    use, link_dir = use_source_tree
    use()
    assert sys.path[0] == str(link_dir) and stat.S_IMODE(link_dir.lstat().st_mode) == 0o700
    assert os.readlink(link_dir / "moehal") == str(ROOT / "core")


def test_ep_gpu_check_refuses_a_folder_planted_at_its_name(use_source_tree, tmp_path):
    """The name is predictable: a link, or (as root here) another user's folder, made there
    first is refused, not put first on sys.path."""
    use, link_dir = use_source_tree
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link_dir.symlink_to(elsewhere)
    path = list(sys.path)
    with pytest.raises(SystemExit, match="not a folder of yours"):
        use()
    assert sys.path == path and not any(elsewhere.iterdir())
    if os.getuid() == 0:
        link_dir.unlink()
        link_dir.mkdir(mode=0o777)
        os.chown(link_dir, 4242, -1)
        with pytest.raises(SystemExit, match="not a folder of yours"):
            use()
        assert sys.path == path and not any(link_dir.iterdir())
