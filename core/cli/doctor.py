"""`moehal doctor`: hardware seen, plugins loaded or failed, backends available or why not, and
each component of the available backends: whether it can run on this machine, and why not."""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Sequence
from typing import Any

import moehal
import torch
from moehal.cli.common import cell, console, print_json, status_text, table
from moehal.errors import MoEHalError
from moehal.hardware import HardwareInfo, detect, package_version
from moehal.kernels.host import kernels_interpreted
from moehal.selection import machine_decision

_EXIT_CODES = """exit status:
  0  the report was made
  1  MOEHAL_STRICT_PLUGINS is set and a plugin failed to load (every failure is reported)
  2  --device names a device this machine lacks (the report says why; nothing was probed)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="show hardware, plugins and backend availability",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device", default=None, help="device to check (default: the best torch sees)")
    p.set_defaults(func=run)


def collect(device: str | None = None) -> dict[str, Any]:
    """The doctor report as plain data. Plugins are loaded non-strictly even under
    MOEHAL_STRICT_PLUGINS, so that every failing plugin is reported, not only the first; a
    `device` this machine lacks is reported under hardware["error"] (backends not probed)."""
    strict = moehal.Settings.from_env().strict
    reg = moehal.discover(strict=False) if strict else moehal.discover()
    hw: HardwareInfo | None = None
    hw_error = None
    try:
        hw = detect(device)
    except MoEHalError as exc:
        hw_error = str(exc)
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
            if hw is None:  # no such device here: nothing to probe
                entry["available"], entry["reason"] = False, f"not checked: device {device!r} is not available here"
            else:
                try:
                    avail = rec.info.available(hw)
                    entry["available"], entry["reason"] = avail.ok, avail.reason
                except Exception as exc:  # noqa: BLE001 - a plugin's probe must not break doctor
                    why = f"availability probe raised {type(exc).__name__}: {exc}"
                    entry["available"], entry["reason"] = False, why
            try:
                entry["libraries"] = rec.info.libraries()
            except Exception as exc:  # noqa: BLE001
                entry["libraries"] = {"<error>": f"{type(exc).__name__}: {exc}"}
            entry["description"] = rec.info.description
            entry["components"] = _components(reg, name, hw) if hw is not None else []
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
        }
        if hw is not None
        else {"kind": None, "device": device, "name": None, "capability": None, "arch": None, "error": hw_error},
        "settings": {
            "backend": reg.settings.backend,
            "disabled_plugins": sorted(reg.settings.disabled_plugins),
            "strict": strict,
            "emulate": sorted(reg.settings.emulate),
            "masked_workspace_gib": reg.settings.masked_workspace_gib,
            # where they came from: the variables set (the rest are defaults), and Triton's mode
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOEHAL_")},
            "triton_interpret": kernels_interpreted(),
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
    failed = [b for b in report["backends"] if b["status"] == "failed"]
    rc = 2 if report["hardware"].get("error") else 1 if report["settings"]["strict"] and failed else 0
    if args.json:
        print_json(report)
        return rc
    hw = report["hardware"]
    cap = f" (compute capability {hw['capability'][0]}.{hw['capability'][1]})" if hw["capability"] else ""
    console.print(
        f"[bold]moehal {report['moehal']}[/bold]  python {report['python']}  torch {report['torch']}"
        f"  triton {report['triton'] or '-'}"
    )
    if hw.get("error"):
        console.print(f"[red]hardware: {cell(hw['error'])}[/red]")
    else:
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
    for b in failed:
        console.print(
            f"[red]plugin {cell(b['name'])} ({cell(b['distribution'] or b['module'])}) failed to load:[/red] "
            f"{cell(b['error'])}"
        )
    s = report["settings"]
    shown = {k: v for k, v in s.items() if k not in ("environment", "triton_interpret", "strict")}
    console.print(
        "settings: "
        + ", ".join(f"{k}={v}" for k, v in shown.items())
        + ("; from " + ", ".join(f"{k}={v}" for k, v in s["environment"].items()) if s["environment"] else "; defaults")
        + ("; Triton kernels interpreted (TRITON_INTERPRET)" if s["triton_interpret"] else ""),
        markup=False,
    )
    if s["strict"] and failed:
        console.print(f"[red]MOEHAL_STRICT_PLUGINS is set and {len(failed)} plugin(s) failed to load[/red]")
    return rc
