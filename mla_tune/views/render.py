"""The one output vocabulary of every read command: titled tables of raw values, rendered as a
rich table, markdown or CSV; JSON comes from the view's own `to_json()`.

A view builds `Table`s of raw values (numbers stay numbers); formatting for people happens here,
so CSV and JSON carry the exact stored numbers while tables and markdown carry rounded ones.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence


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
        if not t.rows:
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


def to_rich(tables: Sequence[Table]) -> list:
    """rich renderables (imported lazily: only the table format needs rich)."""
    from rich.markup import escape
    from rich.table import Table as RichTable
    from rich.text import Text

    out = []
    for t in tables:
        rt = RichTable(title=escape(t.title), title_justify="left",
                       caption=escape(t.caption) if t.caption else None, caption_justify="left")
        for c in t.columns:
            rt.add_column(escape(c.name), justify=c.justify, overflow="fold")
        for r in t.rows:
            rt.add_row(*(Text(cell(v, c.fmt)) for v, c in zip(r, t.columns)))
        if not t.rows:
            rt.add_row(*(["(none)"] + [""] * (len(t.columns) - 1)))
        out.append(rt)
    return out


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
