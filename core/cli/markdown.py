"""Markdown table cells from text that moehal does not control (a plugin's decline reason, an
exception, a device name): conformance reports, goal tables and the docs' report pages publish
them, and mkdocs passes inline HTML through to the site."""

from __future__ import annotations

import html
import re

__all__ = ["cell", "code"]

_NEWLINES = re.compile(r"[\r\n\u2028\u2029\x0b\x0c\x85]+")


def cell(text: object) -> str:
    """`text` for a table cell, as Markdown that shows it and nothing more: `&`, `<`, `>` as HTML
    entities (a reason could carry a script); `](` with its bracket escaped, so no link or image
    (`[x](javascript:...)`) is made; `|` escaped; line breaks as spaces (a new line would end the
    table row, and the next could start a raw HTML block)."""
    text = html.escape(_NEWLINES.sub(" ", str(text)), quote=False)
    return text.replace("](", "\\](").replace("|", "\\|")


def code(text: object) -> str:
    """`text` as a code span, which Markdown shows verbatim (HTML escaped by the renderer): on one
    line, fenced by more backticks than any run of them inside it."""
    text = _NEWLINES.sub(" ", str(text))
    fence = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
