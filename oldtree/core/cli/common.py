"""Shared CLI helpers: rich console, JSON output, decision rendering."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


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
