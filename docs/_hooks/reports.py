"""mkdocs hook: list the committed reports on the Reports page at build time.

Each marker must stand alone on its line. `<!-- reports:DIR -->` in a page becomes a table
of the files under docs/DIR (newest first), so a report committed by a device run appears
without editing the page.
`<!-- goals:FILE.json FILE.json ... -->` (paths under docs/) becomes the performance goals'
summary computed from those `moehal bench` runs (`moehal.bench_goals`), never typed by hand.
`<!-- goals:--pair-across-files FILE.json ... -->` pairs a ratio's rows across the files, as
`moehal goals --pair-across-files` does.
`<!-- components:FILE.json -->` (a conformance report under docs/) becomes its components
table: each dispatcher, experts kernel and fused forward, verified or not run and why.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# A marker counts only alone on its line: one quoted in a sentence or a code span
# (`<!-- goals:... -->`, as the docs that explain markers write them) stays text.
_MARK = re.compile(r"^<!-- reports:([\w\-/]+) -->[ \t]*$", re.MULTILINE)
_GOALS = re.compile(r"^<!-- goals:([^>\n]+?) -->[ \t]*$", re.MULTILINE)
_COMPONENTS = re.compile(r"^<!-- components:([^>\n]+?) -->[ \t]*$", re.MULTILINE)
_KINDS = {".md": "report", ".json": "machine-readable", ".log": "log", ".png": "plot", ".txt": "text"}


def _table(docs_dir: Path, page_dir: Path, sub: str) -> str:
    root = docs_dir / sub
    files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.name, reverse=True)
    if not files:
        return f"_No reports are committed under `docs/{sub}/` yet._"
    rows = ["| file | kind |", "|---|---|"]
    for p in files:
        rel = Path(*([".."] * len(page_dir.relative_to(docs_dir).parts)), p.relative_to(docs_dir)).as_posix()
        rows.append(f"| [{p.relative_to(root).as_posix()}]({rel}) | {_KINDS.get(p.suffix, p.suffix)} |")
    return "\n".join(rows)


def _goals(docs_dir: Path, paths: str) -> str:
    from moehal.bench_goals import check_runs, goals_markdown

    words = paths.split()
    across = "--pair-across-files" in words
    files = [docs_dir / p for p in words if p != "--pair-across-files"]
    return goals_markdown(check_runs(files, across_files=across), cells=False)


def _conformance_report(src: Path) -> dict:
    """A conformance JSON report: `schema` "moehal.conformance/1", or none (before session 58)."""
    import json

    report = json.loads(src.read_text())
    schema = report.get("schema", "moehal.conformance/1")
    if schema.split("/")[0] != "moehal.conformance" or schema.split("/")[-1] != "1":
        raise ValueError(f"{src}: schema {schema!r}, not a moehal conformance report this hook reads")
    return report


def _verdict(report: dict) -> str:
    """The report's verdict; reports before session 57 hold only `ok` and `select` (a `-k` subset)."""
    summary = report["summary"]
    if "verdict" in summary:
        return summary["verdict"].replace("`", "")
    text = "PASS" if summary["ok"] else "not PASS"
    return text + (f", subset (-k {report['select']})" if report.get("select") else "")


def _components(docs_dir: Path, page_dir: Path, path: str) -> str:
    """The components table of a committed report; its text (a plugin's names and reasons)
    escaped as the report's own Markdown escapes it (`moehal.cli.markdown`)."""
    from moehal.cli.markdown import cell as _escape
    from moehal.cli.markdown import code as _code

    src = docs_dir / path.strip()
    report = _conformance_report(src)
    up = [".."] * len(page_dir.relative_to(docs_dir).parts)
    link = Path(*up, src.relative_to(docs_dir).with_suffix(".md")).as_posix()
    hw = report["hardware"]
    rows = [
        f"Backend {_code(report['backend'])} on {_escape(hw['name'])} ({_escape(hw['device'])}), "
        f"{_escape(report['date'][:10])}, conformance verdict {_escape(_verdict(report))} "
        f"([report]({link})):",
        "",
        "| component | kind | result | detail |",
        "|---|---|---|---|",
    ]
    for c in report.get("components", []):
        cells = (_code(c["qualname"]), _escape(c["kind"]), _escape(c["status"]), _escape(c["detail"]))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# A snippet include spelled any other way than `--8<--` is shown as text: fail the build
# instead (ruff's Markdown formatter once rewrote them as `--8 < --"file"`)
_MANGLED_SNIPPET = re.compile(r"^\s*-+\s*8\s*<\s*-+", re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"])
    for m in _MANGLED_SNIPPET.finditer(markdown):
        if m.group(0).strip() != "--8<--":
            from mkdocs.exceptions import PluginError

            line = markdown.count("\n", 0, m.start()) + 1
            raise PluginError(f'{page.file.src_path}:{line}: a snippet include must read --8<-- "file"')
    if "<!-- goals:" in markdown:
        markdown = _GOALS.sub(lambda m: _goals(docs_dir, m.group(1)), markdown)
    if "<!-- components:" in markdown:
        page_dir = (docs_dir / page.file.src_path).parent
        markdown = _COMPONENTS.sub(lambda m: _components(docs_dir, page_dir, m.group(1)), markdown)
    if "<!-- reports:" not in markdown:
        return markdown
    page_dir = (docs_dir / page.file.src_path).parent
    return _MARK.sub(lambda m: _table(docs_dir, page_dir, m.group(1)), markdown)
