"""Conformance reports: JSON for machines, a Markdown matrix a vendor can publish."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from moehal.cli import markdown as md
from moehal.cli.common import output_files, output_problem, replace_file
from moehal_conformance import components
from moehal_conformance.runner import DECLINED, FAIL, NOT_RUN, PASS, CaseResult
from moehal_conformance.suite import Suite

NUMERIC_FAMILIES = ("matrix", "features", "shapes", "pairs", "padding", "routing")
# The Markdown report's first line starts with this; an existing `.md` that does not is not ours
MD_TITLE = "# moehal conformance report: "
# The JSON report's format: its name, and the version a reader checks (a new version only where a
# field changes meaning or goes; added fields keep it). Reports before session 58 have no `schema`.
SCHEMA = "moehal.conformance/1"
SCHEMA_NAME = SCHEMA.split("/")[0]
# Top-level fields every JSON report holds, with `schema` or without: a `.json` lacking them is not ours
JSON_MARKERS = ("suite_version", "backend", "summary", "cases")


class ReportPathError(Exception):
    """The report cannot go where it was asked to: a file there is not a moehal conformance
    report (`--report README` once overwrote a project's README.md), or it is not a file."""


def to_dict(suite: Suite) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        **suite.metadata(),
        # verdict: the report's own words ("PASS", "FAIL", "PASS, subset (-k ...)"): `ok` alone is
        # also true for a `-k` subset, which is not the backend's verdict
        "summary": {
            **suite.counts(),
            "claimed_anything": suite.claimed_anything,
            "ok": suite.ok,
            "subset": bool(suite.select),
            "verdict": verdict(suite),
        },
        "components": [dataclasses.asdict(c) for c in components.summarize(suite)],
        "cases": [
            {
                "id": r.id,
                "family": r.family,
                "check": r.check,
                "quant": r.quant,
                "layout": r.layout,
                "pipeline": r.pipeline,
                "status": r.status,
                "mode": r.mode,
                "label": r.label,
                "detail": r.detail,
                # NaN and Inf (the metrics of an output with NaN, or of the wrong shape) are not JSON
                "metrics": {k: v if math.isfinite(v) else None for k, v in r.metrics.items()},
                **({"traceback": r.traceback} if r.traceback else {}),
            }
            for r in suite.results
        ],
    }


def _cell(results: list[CaseResult]) -> str:
    if not results:
        return ""
    n = len(results)
    passed = sum(r.status == PASS for r in results)
    failed = sum(r.status == FAIL for r in results)
    declined = sum(r.status == DECLINED for r in results)
    modes = {r.mode for r in results if r.status == PASS and r.mode != "native"}
    mode = f" ({', '.join(sorted(modes))})" if modes else ""
    if failed:
        return f"**FAIL {failed}**/{n}"
    if declined == n:
        return "declined"
    if passed == 0:
        return "not run"
    return f"pass {passed}/{n}{mode}" + (f", {declined} declined" if declined else "")


def verdict(suite: Suite) -> str:
    """The run's verdict in words: PASS, FAIL, INCOMPLETE (interrupted), NOTHING RAN / CLAIMED,
    with ", subset (-k `...`)" where `-k` chose the cases, ", subset (pytest selection: `...`)" where
    pytest's node ids did (a subset's verdict is not the backend's)."""
    counts = suite.counts()
    nothing = "NOTHING RAN" if suite.select else "NOTHING CLAIMED"
    text = (
        "PASS"
        if suite.ok
        else ("FAIL" if counts[FAIL] else ("INCOMPLETE (interrupted)" if suite.interrupted else nothing))
    )
    return text + (f", subset ({suite.select_by} `{suite.select}`)" if suite.select else "")


def to_markdown(suite: Suite) -> str:
    meta, counts = suite.metadata(), suite.counts()
    hw = meta["hardware"]
    cap = f" (compute capability {hw['capability'][0]}.{hw['capability'][1]})" if hw["capability"] else ""
    libs = ", ".join(f"{k} {v or 'missing'}" for k, v in meta["vendor_libraries"].items()) or "none"
    backend = md.code(meta["backend"])
    software = (
        f"moehal {meta['moehal_version']}, suite {meta['suite_version']}, python {meta['python']}, "
        f"torch {meta['torch']} (cuda {meta['torch_cuda']}), triton {meta['triton']}"
    )
    lines = [
        f"# moehal conformance report: backend {backend}",
        "",
        f"**Verdict: {verdict(suite)}**: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[DECLINED]} declined, "
        f"{counts[NOT_RUN]} not run.",
        "",
    ]
    if suite.lost_in:
        lines += [
            f"**The device's context was lost** in {md.code(suite.lost_in)} ({md.cell(suite.lost_error)}). "
            "A process cannot "
            "recover from a kernel fault, so the cases after it did not run: the JSON report holds the "
            "failure's traceback.",
            "",
        ]
    lines += [
        "| | |",
        "|---|---|",
        f"| backend | {backend} (plugin {md.cell(meta['plugin_version'])}, {md.cell(meta['plugin_distribution'])}) |",
        f"| hardware | {md.cell(hw['kind'])} {md.code(hw['device'])} {md.cell(hw['name'])}{cap} |",
        f"| software | {md.cell(software)} |",
        f"| vendor libraries | {md.cell(libs)} |",
        f"| emulated backends | {md.cell(', '.join(meta['emulate']) or 'none')} |",
        f"| date | {md.cell(meta['date'])} |",
        f"| profile | {md.cell(meta['profile'])} |",
        f"| fresh allocations | {_poison_line(meta)} |",
        "",
        "`pass (emulated)`: vendor ops ran as documented torch stand-ins; `pass (interpreted)`: the real kernel "
        "code ran under an interpreter (TRITON_INTERPRET=1). Neither is a hardware result.",
        "",
        *_components_section(suite),
        "## Matrix: quant scheme x layout (matrix, features, shapes, pairs, padding, routing)",
        "",
    ]
    grid: dict[str, dict[str, list[CaseResult]]] = defaultdict(lambda: defaultdict(list))
    layouts: list[str] = []
    for r in suite.results:
        if r.family in NUMERIC_FAMILIES:
            grid[r.quant][r.layout].append(r)
            if r.layout not in layouts:
                layouts.append(r.layout)
    order = sorted(layouts, key=lambda x: (x == "-", x))
    lines.append("| quant | " + " | ".join("declined (no pipeline)" if x == "-" else md.cell(x) for x in order) + " |")
    lines.append("|---" * (len(order) + 1) + "|")
    for quant in sorted(grid):
        lines.append(f"| {md.cell(quant)} | " + " | ".join(_cell(grid[quant][x]) for x in order) + " |")
    tuned = [r for r in suite.results if r.family == "tuned"]
    if tuned:  # model shapes the backend's tables tune, one batch size per path (`tuned_shapes`)
        lines += ["", "## Tuned shapes (each declared batch size)", "", "| case | result | rel_l2 |", "|---|---|---|"]
        lines += [
            f"| {md.cell(r.id)} | {md.cell(r.label)} | {r.metrics['rel_l2']:.1e} |"
            if "rel_l2" in r.metrics
            else f"| {md.cell(r.id)} | {md.cell(r.label)} | |"
            for r in tuned
        ]
    lines += ["", "## Behaviour", "", "| case | result |", "|---|---|"]
    for r in suite.results:
        if r.family not in (*NUMERIC_FAMILIES, "tuned"):
            lines.append(f"| {md.cell(r.id)} | {md.cell(r.label)} |")
    failures = [r for r in suite.results if r.status == FAIL]
    if failures:
        lines += ["", "## Failures", "", "| case | detail |", "|---|---|"]
        lines += [f"| {md.cell(r.id)} | {md.cell(r.detail)} |" for r in failures]
    declines = sorted({(r.id, r.detail) for r in suite.results if r.status == DECLINED})
    if declines:
        lines += ["", "## Declined (with the backend's reasons)", "", "| case | reason |", "|---|---|"]
        lines += [f"| {md.cell(i)} | {md.cell(d)} |" for i, d in declines]
    lines += [
        "",
        "<details><summary>All cases</summary>",
        "",
        "| case | pipeline | result | error |",
        "|---|---|---|---|",
    ]
    for r in suite.results:
        err = f"{r.metrics['rel_l2']:.1e}" if "rel_l2" in r.metrics else ""
        lines.append(f"| {md.cell(r.id)} | {md.cell(r.pipeline)} | {md.cell(r.label)} | {err} |")
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def _poison_line(meta: dict[str, Any]) -> str:
    if not meta["poison"]:
        return "not poisoned"
    return f"poisoned: NaN in floats, 1 in integers ({meta['poisoned_allocations']} allocations)"


def _components_section(suite: Suite) -> list[str]:
    """Each declared dispatcher, experts kernel and fused forward: verified, emulated,
    interpreted, FAIL, or not run with its reason (`moehal_conformance.components`)."""
    rows = components.summarize(suite)
    if not rows:
        return []
    lines = [
        "## Components",
        "",
        "What this run did with each dispatcher, experts kernel and fused forward the backend declares. "
        "`verified`: it passed natively on this device; `not run`: no case ran it, for the reason given.",
        "",
        "| component | kind | result | detail |",
        "|---|---|---|---|",
    ]
    for c in rows:
        result = f"**{c.status}**" if c.status == components.FAILED else c.status
        lines.append(f"| {md.code(c.qualname)} | {md.cell(c.kind)} | {result} | {md.cell(c.detail)} |")
    return [*lines, ""]


def report_paths(path: str | Path) -> tuple[Path, Path]:
    """`<path>.json` and `<path>.md` (`moehal.cli.common.output_files`: a `.md` or `.json` suffix
    on path is replaced, any other kept, as in `acme-0.1.2`). ValueError where path names no file."""
    js, md = output_files(path, (".json", ".md"))
    return js, md


def is_report(path: Path) -> bool:
    """Whether the existing file `path` is a moehal conformance report (a JSON object with the
    report's fields, or Markdown whose first line is the report's title): one to overwrite."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                return False
            return str(data.get("schema", "")).startswith(f"{SCHEMA_NAME}/") or all(k in data for k in JSON_MARKERS)
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(MD_TITLE)
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: not a report
        return False


def check_writable(path: str | Path) -> tuple[Path, Path]:
    """Before a run: `ReportPathError` where `write` would overwrite a file that is not a report,
    or where the reports' folder cannot be made or written to (a run of minutes whose report
    then failed to write was lost). Makes nothing: `write` makes a missing folder, so a run
    stopped or refused before its report leaves no empty folder behind."""
    try:
        js, md = report_paths(path)
    except ValueError as exc:  # '.', '..': it wrote hidden .json and .md files
        raise ReportPathError(str(exc)) from None
    why = output_problem((js, md), is_report, "a moehal conformance report")
    if why is not None:
        raise ReportPathError(why)
    return js, md


def write(suite: Suite, path: str | Path) -> tuple[Path, Path]:
    """Write `<path>.json` and `<path>.md` (a `.md` or `.json` suffix on path is replaced), each
    in one step (`replace_file`: a run stopped mid-write leaves the previous report whole; it
    makes the folder where it is missing); an
    existing file of either name that is not a moehal conformance report is left alone
    (`ReportPathError`). OSError where a write fails."""
    js, md = check_writable(path)
    text = json.dumps(to_dict(suite), indent=2, default=str, allow_nan=False)
    replace_file(js, lambda part: part.write_text(text))
    markdown = to_markdown(suite)
    replace_file(md, lambda part: part.write_text(markdown))
    return js, md
