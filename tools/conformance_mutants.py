"""Mutation audit: does the conformance suite (or a test file) notice a small bug in a backend?

Each mutant is one textual edit of one source file (old text -> new text, the old text found
exactly once). The runner copies the four import packages (`moehal`, `moehal_cuda`, `moehal_npu`,
`moehal_rocm`, `moehal_conformance`) into a private folder, applies the edit there and runs a
command with that folder first on PYTHONPATH, so the working tree and the editable install stay
untouched. A mutant is *killed* when the command fails (or times out) and *survives* when it
passes. The unmutated copy runs first: a baseline that fails makes every verdict meaningless.

Mutants live in a Python file that defines `MUTANTS`, a list of `Mutant`:

    from conformance_mutants import Mutant
    NPU = ["moehal", "conformance", "--backend", "npu", "--emulate", "--quick"]
    MUTANTS = [Mutant("npu-swap-gate-up", "backends_npu/experts.py", "a, b = x.chunk(2, -1)",
                      "b, a = x.chunk(2, -1)", "gate and up halves swapped", NPU)]

    python tools/conformance_mutants.py MUTANTS.py [--only ID ...] [--json OUT.json]

A survivor is either an equivalent mutant (the edit changes no result the contract defines) or
a blind spot of the checks; the verdicts and the reasoning go in the audit's record
(docs/device-runs/... or the session README), not in this tool.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder in the tree -> import name, as pyproject's package-dir maps them
PACKAGES = {
    "core": "moehal",
    "backends_cuda": "moehal_cuda",
    "backends_npu": "moehal_npu",
    "backends_rocm": "moehal_rocm",
    "conformance": "moehal_conformance",
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # path in the tree, e.g. "backends_npu/experts.py"
    old: str  # text found exactly once in the file
    new: str
    why: str  # the bug this edit stands for
    command: list[str]  # run from the tree's root; "moehal" means this Python's CLI
    timeout_s: float = 600.0


def _copy_packages(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder, name in PACKAGES.items():
        shutil.copytree(ROOT / folder, dest / name, ignore=ignore)


def _mutated_path(dest: Path, file: str) -> Path:
    folder, _, rest = file.partition("/")
    if folder not in PACKAGES:
        raise ValueError(f"{file}: mutants edit the packages only ({', '.join(PACKAGES)})")
    return dest / PACKAGES[folder] / rest


def apply(m: Mutant, dest: Path) -> None:
    path = _mutated_path(dest, m.file)
    path.write_text(path.read_text().replace(m.old, m.new, 1))


def check(m: Mutant) -> None:
    """Raise unless `m.old` occurs exactly once in the working tree's file."""
    n = (ROOT / m.file).read_text().count(m.old)
    if n != 1:
        raise ValueError(f"{m.id}: the old text occurs {n} times in {m.file} (must be once)")


def _argv(command: list[str]) -> list[str]:
    if command and command[0] == "moehal":
        return [sys.executable, "-m", "moehal.cli.main", *command[1:]]
    if command and command[0] == "pytest":
        return [sys.executable, "-m", "pytest", *command[1:]]
    return list(command)


def run(command: list[str], pythonpath: Path, timeout_s: float) -> tuple[str, float, str]:
    """(verdict, seconds, output tail): 'pass', 'fail' or 'timeout'."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_INTERPRET", "1")
    t0 = time.monotonic()
    try:
        p = subprocess.run(_argv(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", time.monotonic() - t0, out[-1500:]
    verdict = "pass" if p.returncode == 0 else "fail"
    return verdict, time.monotonic() - t0, (p.stdout + p.stderr)[-1500:]


def load(path: Path) -> list[Mutant]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    spec = importlib.util.spec_from_file_location("_mutants", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mutants = list(mod.MUTANTS)
    ids = [m.id for m in mutants]
    if len(set(ids)) != len(ids):
        raise ValueError("mutant ids repeat")
    return mutants


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mutants", type=Path, help="a Python file defining MUTANTS")
    ap.add_argument("--only", nargs="*", default=None, help="mutant ids to run")
    ap.add_argument("--json", type=Path, default=None, help="write the verdicts here")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    args = ap.parse_args(argv)

    mutants = load(args.mutants)
    if args.only:
        mutants = [m for m in mutants if m.id in set(args.only)]
    results = []
    with tempfile.TemporaryDirectory(prefix="moehal-mutants-") as tmp:
        base = Path(tmp) / "baseline"
        _copy_packages(base)
        for m in mutants:  # every edit must apply before anything runs
            check(m)
        if not args.no_baseline:
            for cmd in {tuple(m.command) for m in mutants}:
                verdict, secs, tail = run(list(cmd), base, max(m.timeout_s for m in mutants))
                print(f"baseline {' '.join(cmd)}: {verdict} ({secs:.0f} s)", flush=True)
                if verdict != "pass":
                    print(tail, file=sys.stderr)
                    return 2
        for i, m in enumerate(mutants, 1):
            dest = Path(tmp) / m.id
            _copy_packages(dest)
            apply(m, dest)
            verdict, secs, tail = run(m.command, dest, m.timeout_s)
            status = {"pass": "SURVIVED", "fail": "killed", "timeout": "killed (timeout)"}[verdict]
            print(f"[{i}/{len(mutants)}] {m.id}: {status} ({secs:.0f} s) - {m.why}", flush=True)
            results.append({**dataclasses.asdict(m), "status": status, "seconds": round(secs, 1), "tail": tail})
            shutil.rmtree(dest, ignore_errors=True)
    survivors = [r["id"] for r in results if r["status"] == "SURVIVED"]
    print(f"{len(results) - len(survivors)} killed, {len(survivors)} survived: {', '.join(survivors) or '-'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
