"""Progress of long work for people: a rich progress bar on a terminal; in a pipe or a CI log,
where a bar draws nothing, one plain line every few seconds (and at the start and end)."""

from __future__ import annotations

import time
from typing import Callable

LINE_EVERY_S = 5.0      # a plain progress line at most this often


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class LineProgress:
    """Progress as lines: `what: done/total unit, elapsed m:ss, eta m:ss, note`, printed when
    `every` seconds have passed since the last one, on start and on close."""

    def __init__(self, console, what: str, total: int, unit: str = "", every: float = LINE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.console, self.what, self.total, self.unit = console, what, max(total, 1), unit
        self.every, self.clock = every, clock
        self.done, self.note = 0, ""
        self.t0 = self.last = clock()
        self._print()

    def update(self, done: int | None = None, note: str | None = None, total: int | None = None,
               advance: int = 0) -> None:
        if total is not None:
            self.total = max(total, 1)
        if note is not None:
            self.note = note
        self.done = (done if done is not None else self.done) + advance
        if self.clock() - self.last >= self.every:
            self._print()

    def close(self) -> None:
        if self.console is not None:
            self._print()
            self.console = None

    def line(self) -> str:
        elapsed = self.clock() - self.t0
        eta = (f", eta {_clock(elapsed * (self.total - self.done) / self.done)}"
               if 0 < self.done < self.total else "")
        unit = f" {self.unit}" if self.unit else ""
        note = f", {self.note}" if self.note else ""
        return f"{self.what}: {self.done}/{self.total}{unit}, {_clock(elapsed)}{eta}{note}"

    def _print(self) -> None:
        if self.console is None:
            return
        self.last = self.clock()
        line = self.line()
        if line != getattr(self, "_printed", None):
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
            self._printed = line


class BarProgress:
    """The same interface over a rich progress bar (terminals only)."""

    def __init__(self, console, what: str, total: int, unit: str = ""):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)
        self.progress = Progress(SpinnerColumn(), TextColumn(what), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                                 console=console, transient=True)
        self.progress.start()
        self.task = self.progress.add_task(what, total=max(total, 1), note="")

    def update(self, done: int | None = None, note: str | None = None, total: int | None = None,
               advance: int = 0) -> None:
        kw = {}
        if total is not None:
            kw["total"] = max(total, 1)
        if note is not None:
            kw["note"] = note
        if done is not None:
            kw["completed"] = done
        self.progress.update(self.task, advance=advance or None, **kw)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def progress_for(console, what: str, total: int, unit: str = ""):
    """A bar where the console is a terminal, else lines every LINE_EVERY_S seconds."""
    if console.is_terminal:
        return BarProgress(console, what, total, unit)
    return LineProgress(console, what, total, unit)
