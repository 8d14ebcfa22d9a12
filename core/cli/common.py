"""Shared CLI helpers: rich console, JSON output, decision rendering."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Width of tables written to a file or a pipe (a device run's log, CI): rich would assume 80
# columns there and cut the benchmark's cells to "…" (session 25's first logs were unreadable).
LOG_WIDTH = 220


def make_console(**kwargs: Any) -> Console:
    """A rich console; where it writes to no terminal and `COLUMNS` is unset, `LOG_WIDTH` wide."""
    c = Console(**kwargs)
    if not c.is_terminal and "width" not in kwargs and not os.environ.get("COLUMNS"):
        c = Console(width=LOG_WIDTH, **kwargs)
    return c


console = make_console()


def finite(data: Any) -> Any:
    """`data` with every NaN and infinity as None (JSON's null): JSON has no NaN, and parsers
    other than Python's (JavaScript's, jq) refuse the `NaN` that `json.dumps` writes by default."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def json_text(data: Any) -> str:
    """Strict JSON of moehal's machine-readable outputs (`finite`; anything else as its str)."""
    return json.dumps(finite(data), indent=2, default=str, allow_nan=False) + "\n"


def print_json(data: Any) -> None:
    print(json_text(data), end="")


def status_text(ok: bool, yes: str = "yes", no: str = "no") -> str:
    return f"[green]{yes}[/green]" if ok else f"[red]{no}[/red]"


def table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def cell(value: object) -> str:
    """Escape text for a rich table cell (format names contain square brackets)."""
    return escape(str(value))
