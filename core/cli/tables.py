"""Tables that fit the console without cutting a cell: `FittedTable`.

rich shrinks a table wider than the console by cutting its cells to "…" (`moehal bench`'s 16-18
columns read `│ … │ … │` at 60 columns, its times `551…` at 120). A `FittedTable` renders its
table at the width it is given instead: every column at least as wide as its longest word (a
number is one word, so it is never cut nor folded), cells and headers wrapping at spaces, and
where even that is too wide, the columns split over several tables that each repeat the row's
key columns (its first `keys`). Where the key columns and one more do not fit, each row becomes
a table section of (column, value) lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rich.console import Console, ConsoleOptions, RenderableType
from rich.table import Table
from rich.text import Text


def _lines(cell: RenderableType) -> list[str]:
    text = cell.plain if isinstance(cell, Text) else Text.from_markup(cell).plain if isinstance(cell, str) else ""
    return text.splitlines() or [""]


def _words(cells: Iterable[RenderableType]) -> list[list[int]]:
    """The widths of each line's words, over `cells` (a column's header and cells), in terminal cells."""
    lines = [line for c in cells for line in _lines(c)]
    return [[Text(w).cell_len for w in line.split()] or [0] for line in lines]


def _height(lines: list[list[int]], width: int) -> int:
    """Lines that the column's longest line takes at `width`, wrapped at spaces (a longer word folds)."""
    tallest = 0
    for words in lines:
        n, used = 1, 0
        for w in words:
            if used and used + 1 + w > width:
                n, used = n + 1, 0
            n += max(0, -(-w // width) - 1)
            used = w % width or width if used == 0 else used + 1 + w
        tallest = max(tallest, n)
    return tallest


def _widths(lines: list[list[int]]) -> tuple[int, int]:
    """(longest word, longest line) of a column's `_words`."""
    return max(1, *(max(ws) for ws in lines)), max(1, *(sum(ws) + len(ws) - 1 for ws in lines))


class FittedTable:
    """`table` (a boxed rich table, padding 1 each side) rendered to fit the console's width; its
    first `keys` columns say which row a line is and are repeated in each table of a split."""

    def __init__(self, table: Table, keys: int = 1) -> None:
        self.table = table
        self.keys = keys

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Table]:
        yield from self.tables(options.max_width)

    def tables(self, width: int) -> list[Table]:
        """The table as one or more tables, none wider than `width` where their key columns and
        each other column's longest word fit in it (narrower than that, cells fold)."""
        cols = self.table.columns
        words = [_words((c.header, *c.cells)) for c in cols]
        sizes = [_widths(w) for w in words]
        keys, rest = list(range(min(self.keys, len(cols)))), list(range(self.keys, len(cols)))

        def need(group: list[int]) -> int:  # longest words, padding 2 and a border 1 per column, the edge
            return sum(sizes[i][0] for i in group) + 3 * len(group) + 1

        groups: list[list[int]] = []
        group = list(keys)
        for i in rest:
            if group != keys and need([*group, i]) > width:
                groups.append(group)
                group = list(keys)
            group.append(i)
        groups.append(group)
        if any(need(g) > width for g in groups) and self.table.row_count:
            records = self._records(width)
            if records is not None:
                return [records]
        return [self._part(g, width, words, n) for n, g in enumerate(groups)]

    def _records(self, width: int) -> Table | None:
        """Each row as a section of (column, value) lines, for a console too narrow for the key
        columns beside any other; None where even that does not fit."""
        t = self.table
        names = _widths(_words(c.header for c in t.columns))
        values = _widths(_words(cell for c in t.columns for cell in c.cells))
        if names[0] + values[0] + 7 > width:
            return None
        part = Table(title=t.title, title_justify=t.title_justify, box=t.box, show_header=False)
        part.add_column(overflow="fold", width=max(names[0], min(names[1], width - 7 - values[1])))
        part.add_column(overflow="fold")
        cells = [list(c.cells) for c in t.columns]
        for r in range(t.row_count):
            for i, c in enumerate(t.columns):
                part.add_row(c.header, cells[i][r], end_section=i == len(t.columns) - 1)
        return part

    def _part(self, group: list[int], width: int, words: list[list[list[int]]], n: int) -> Table:
        t = self.table
        title = t.title if n == 0 or t.title is None else f"{t.title} (continued)"
        part = Table(title=title, title_justify=t.title_justify, box=t.box, show_lines=t.show_lines)
        sizes = [_widths(words[i]) for i in group]
        widths = [lo for lo, _ in sizes]
        spare = width - (sum(widths) + 3 * len(group) + 1)
        if spare < 0:  # too narrow even for the longest words: let rich share the width, folding
            widths = [0] * len(group)
        heights = [_height(words[i], w) for i, w in zip(group, widths)] if spare > 0 else []
        while spare > 0:  # a column more to the tallest of the columns that can still widen: fewer lines
            grow = [k for k in range(len(group)) if widths[k] < sizes[k][1]]
            if not grow:
                break
            k = max(grow, key=lambda k: (heights[k], -k))
            widths[k] += 1
            heights[k] = _height(words[group[k]], widths[k])
            spare -= 1
        for i, w in zip(group, widths):
            c = t.columns[i]
            part.add_column(
                c.header, style=c.style, header_style=c.header_style, justify=c.justify,
                overflow="fold", no_wrap=False, width=w or None,
            )  # fmt: skip
        cells = [list(t.columns[i].cells) for i in group]
        for r in range(t.row_count):
            part.add_row(*(c[r] for c in cells))
        return part
