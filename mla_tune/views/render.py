"""The one output vocabulary of every read command: titled tables of raw values, rendered as a
rich table, markdown or CSV; JSON comes from the view's own `to_json()`.

A view builds `Table`s of raw values (numbers stay numbers); formatting for people happens here,
so CSV and JSON carry the exact stored numbers while tables and markdown carry rounded ones.

A table for people fits the width it is printed at (a terminal's, or 80 columns in a pipe or a
CI log) or becomes a list: one line per row, `name value` pairs, never columns folded into a few
characters each (`FitTable`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

from rich.markup import escape
from rich.table import Table as RichTable
from rich.text import Text


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"
    markdown = "markdown"


@dataclass(frozen=True)
class Column:
    name: str
    fmt: str | Callable[[Any], str] = ""      # format spec or function for table/markdown cells
    justify: str = "right"
    wrap: bool = False                        # prose (a reason, a message): may wrap in a table


@dataclass
class Table:
    title: str
    columns: Sequence[Column]
    rows: list = field(default_factory=list)  # lists of raw values, one per column
    caption: str = ""                         # a line under the table (why, notes)

    def add(self, *values) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"{self.title}: {len(values)} values for {len(self.columns)} columns")
        self.rows.append(list(values))


def cell(value, fmt: str | Callable[[Any], str] = "") -> str:
    """A value as a person reads it: '-' for missing, numbers by the column's format."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if callable(fmt):
        return fmt(value)
    if isinstance(value, bool):
        return "yes" if value else ""
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


def to_markdown(tables: Sequence[Table], heading: str = "") -> str:
    out = [f"# {heading}", ""] if heading else []
    for t in tables:
        out += [f"## {t.title}", ""]
        if not t.columns:
            pass
        elif not t.rows:
            out += ["(none)", ""]
        else:
            out.append("| " + " | ".join(c.name for c in t.columns) + " |")
            out.append("|" + "|".join("---:" if c.justify == "right" else "---" for c in t.columns) + "|")
            for r in t.rows:
                out.append("| " + " | ".join(_md_escape(cell(v, c.fmt)) for v, c in zip(r, t.columns)) + " |")
            out.append("")
        if t.caption:
            out += [t.caption, ""]
    return "\n".join(out).rstrip() + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_csv(table: Table) -> str:
    """One table as CSV with raw values (None -> empty)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([c.name for c in table.columns])
    for r in table.rows:
        w.writerow(["" if v is None else json.dumps(v, sort_keys=True) if isinstance(v, (dict, list))
                    else v for v in r])
    return buf.getvalue()


WRAP_WIDTH = 28          # a prose column is folded no narrower than this; others never fold


def to_rich(tables: Sequence[Table]) -> list:
    """rich renderables, each a FitTable: a table where it fits the console, else a list."""
    return [FitTable(t) for t in tables]


class FitTable:
    """A Table for rich: drawn as a table when its columns fit the console's width without
    folding any but prose columns (down to WRAP_WIDTH), else as a list, one line per row."""

    def __init__(self, table: Table):
        self.table = table
        self.cells = [[cell(v, c.fmt) for v, c in zip(r, table.columns)] for r in table.rows]

    def natural_width(self) -> int:
        """Columns at their longest cell (prose capped at WRAP_WIDTH, but never narrower than its
        longest word: a class path or a file name is not folded in two), plus rich's borders and
        padding (3 per column, 1 more)."""
        total = 1
        for i, c in enumerate(self.table.columns):
            w = max([len(c.name)] + [len(r[i]) for r in self.cells])
            if c.wrap:
                word = max((len(x) for r in self.cells for x in r[i].split()), default=0)
                w = max(min(w, max(WRAP_WIDTH, len(c.name))), word)
            total += w + 3
        return total

    def fits(self, width: int) -> bool:
        return self.natural_width() <= width

    def __rich_console__(self, console, options):
        # title and caption as lines of their own: the console's width, not the table's; wrapped
        # here at words (rich's own wrap leaves a space at the end of each folded line)
        width = options.max_width
        yield from _wrapped(self.table.title, width, style="bold")
        if not self.table.columns:
            pass            # a title and its caption: a note, no rows
        elif not self.table.rows:
            yield _line("(none)")         # one line, not a box around one empty row
        elif self.fits(width):
            yield self._table()
        else:
            yield from self._list(width)
        if self.table.caption:
            yield from _wrapped(self.table.caption, width, style="dim")
        yield _line("")

    def _table(self):
        t = self.table
        rt = RichTable()
        for c in t.columns:
            rt.add_column(escape(c.name), justify=c.justify, no_wrap=not c.wrap,
                          overflow="fold" if c.wrap else "ellipsis")
        for r in self.cells:
            rt.add_row(*(Text(v) for v in r))
        return rt

    def _list(self, width: int):
        """The list form: one `- name value, ...` item per row (empty cells left out), folded
        only between its `name value` pairs, the folded lines indented under the first."""
        t = self.table
        for r in self.cells:
            pairs = [f"{c.name} {v}" for c, v in zip(t.columns, r) if v not in ("", "-")]
            for ln in _pack(pairs, width):
                yield _line(ln)


def _line(text: str, style: str = ""):
    """One line as rich prints it: never folded again, nothing added at its end."""
    return Text(text, style=style, no_wrap=True, overflow="ignore", end="\n")


def _wrapped(text: str, width: int, style: str = ""):
    """Prose folded at words to `width`, no line ending in a space."""
    for ln in textwrap.wrap(text, max(width, 20), break_long_words=False,
                            break_on_hyphens=False) or [""]:
        yield _line(ln, style)


def _pack(pairs: list[str], width: int, indent: str = "  ") -> list[str]:
    """`- a, b, c` folded between items to `width`; an item longer than a line of its own is
    folded at its words."""
    lines, cur = [], "-"
    for i, p in enumerate(pairs):
        item = p + ("," if i < len(pairs) - 1 else "")
        if cur == "-" or len(cur) + 1 + len(item) <= width:
            cur = f"{cur} {item}"
        else:
            lines.append(cur)
            cur = indent + item
        if len(cur) > width:         # one long item (a reason): folded at its words
            parts = textwrap.wrap(cur, width, subsequent_indent=indent, break_long_words=False,
                                  break_on_hyphens=False)
            lines += parts[:-1]
            cur = parts[-1]
    lines.append(cur)
    return lines


def times(v) -> str:
    """A ratio cell: 1.234 -> "1.23x"."""
    return f"{v:.2f}x"


def render(fmt: str | OutputFormat, tables: Callable[[], Sequence[Table]], heading: str,
           data: Callable[[], Any], csv_text: Callable[[], str]) -> str | list:
    """One view in the format asked for: json, csv, markdown -> text; table -> rich renderables.
    Each part is built only when its format is asked for."""
    fmt = OutputFormat(fmt)
    if fmt is OutputFormat.json:
        return to_json_text(data())
    if fmt is OutputFormat.csv:
        return csv_text()
    if fmt is OutputFormat.markdown:
        return to_markdown(tables(), heading=heading)
    return to_rich(tables())


def to_json_text(data) -> str:
    """JSON for machines: NaN and infinities (not JSON) become null."""
    return json.dumps(_finite(data), indent=1, default=str, allow_nan=False)


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
