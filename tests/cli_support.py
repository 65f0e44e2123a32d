"""Run the `mla-tune` console script in this process, as a user's shell would (through `main()`,
which turns every known error into one line and exit 2): faster than a subprocess, and unlike
CliRunner it does not bypass main's error handling."""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None     # anything but SystemExit escaping main()

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_main(args: list[str], cwd=None) -> CliResult:
    from mla_tune.cli import main
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["mla-tune", *map(str, args)]
    exc = None
    code = 0
    try:
        with contextlib.ExitStack() as stack:
            if cwd is not None:
                stack.enter_context(contextlib.chdir(cwd))
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException as e:  # noqa: BLE001 - a traceback the user would have seen
                exc, code = e, -1
    finally:
        sys.argv = old_argv
    return CliResult(code, out.getvalue(), err.getvalue(), exc)


def one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1
