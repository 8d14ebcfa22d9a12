"""`moehal doctor`: hardware seen, plugins loaded or failed, backends available or why not, and
each component of the available backends: whether it can run on this machine, and why not."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Sequence
from typing import Any

import moehal
import torch
from moehal.cli.common import cell, console, print_json, status_text, table
from moehal.hardware import HardwareInfo, detect, package_version
from moehal.selection import machine_decision


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="show hardware, plugins and backend availability")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device", default=None, help="device to check (default: the best torch sees)")
    p.set_defaults(func=run)


def collect(device: str | None = None) -> dict[str, Any]:
    """The doctor report as plain data."""
    reg = moehal.discover()
    hw: HardwareInfo = detect(device)
    backends = []
    for name, rec in sorted(reg.plugins.items()):
        entry: dict[str, Any] = {
            "name": name,
            "status": rec.status,
            "distribution": rec.distribution,
            "version": rec.version,
            "module": rec.module,
            "error": rec.error,
            "implementations": rec.implementations,
        }
        if rec.info is not None:
            try:
                avail = rec.info.available(hw)
                entry["available"], entry["reason"] = avail.ok, avail.reason
            except Exception as exc:  # noqa: BLE001 - a plugin's probe must not break doctor
                entry["available"], entry["reason"] = False, f"availability probe raised {type(exc).__name__}: {exc}"
            try:
                entry["libraries"] = rec.info.libraries()
            except Exception as exc:  # noqa: BLE001
                entry["libraries"] = {"<error>": f"{type(exc).__name__}: {exc}"}
            entry["description"] = rec.info.description
            entry["components"] = _components(reg, name, hw)
        else:
            entry["available"], entry["reason"] = False, f"plugin {rec.status}: {rec.error}"
            entry["libraries"] = {}
            entry["components"] = []
        backends.append(entry)
    return {
        "moehal": moehal.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "triton": package_version("triton"),
        "hardware": {
            "kind": hw.kind,
            "device": str(hw.device),
            "name": hw.name,
            "capability": hw.capability,
            "arch": hw.arch,
        },
        "settings": {
            "backend": reg.settings.backend,
            "disabled_plugins": sorted(reg.settings.disabled_plugins),
            "strict": reg.settings.strict,
            "emulate": sorted(reg.settings.emulate),
        },
        "backends": backends,
    }


def _components(reg: moehal.Registry, backend: str, hw: HardwareInfo) -> list[dict[str, Any]]:
    """Each dispatcher, experts kernel and fused forward of `backend` (`Registry.components`):
    whether its hardware and library checks pass on this machine, and if not, why
    (`moehal.selection.machine_decision`)."""
    out = []
    for kind, impl in reg.components(backend):
        d = machine_decision(impl, hw, reg.settings)
        out.append({"name": impl.qualname, "kind": kind, "runs_here": d.ok, "reason": d.reason})
    return out


def run(args: argparse.Namespace, rest: Sequence[str] = ()) -> int:
    report = collect(args.device)
    if args.json:
        print_json(report)
        return 0
    hw = report["hardware"]
    cap = f" (compute capability {hw['capability'][0]}.{hw['capability'][1]})" if hw["capability"] else ""
    console.print(
        f"[bold]moehal {report['moehal']}[/bold]  python {report['python']}  torch {report['torch']}"
        f"  triton {report['triton'] or '-'}"
    )
    console.print(f"hardware: {hw['kind']} {hw['device']} {hw['name']}{cap}")
    t = table("Backends", "backend", "plugin", "available", "reason", "vendor libraries")
    for b in report["backends"]:
        libs = ", ".join(f"{k} {v or 'missing'}" for k, v in b["libraries"].items()) or "-"
        plugin = {"loaded": "[green]loaded[/green]", "failed": "[red]FAILED[/red]"}.get(b["status"], b["status"])
        t.add_row(cell(b["name"]), plugin, status_text(b["available"]), cell(b["reason"] or ""), cell(libs))
    console.print(t)
    comps = [c for b in report["backends"] if b["available"] for c in b["components"]]
    if comps:
        ct = table("Components of the available backends", "component", "kind", "runs here", "reason")
        for c in comps:
            why = "" if c["runs_here"] else c["reason"]
            ct.add_row(cell(c["name"]), c["kind"], status_text(c["runs_here"]), cell(why))
        console.print(ct)
    failed = [b for b in report["backends"] if b["status"] == "failed"]
    for b in failed:
        console.print(
            f"[red]plugin {cell(b['name'])} ({cell(b['distribution'] or b['module'])}) failed to load:[/red] "
            f"{cell(b['error'])}"
        )
    s = report["settings"]
    if s["backend"] or s["disabled_plugins"] or s["emulate"]:
        console.print(f"settings: {s}")
    return 0
