"""The Typer app, the shared console, and how errors reach the user (one line, non-zero exit)."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="mla-tune",
    help="Tune MLA decode attention (FlashInfer, vLLM Triton MLA) on this GPU; emit the config vllm_metax loads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

EXIT_USER_ERROR = 2     # bad input: flags, files, DBs
EXIT_FAILURE = 1        # the job ran and failed


class UserError(Exception):
    """An error caused by the user's input; shown as one line, exit code 2."""


def fail(message: str, code: int = EXIT_USER_ERROR):
    err_console.print(f"[bold red]error:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def given(ctx, *names: str) -> list[str]:
    """Which of these parameters the user set on the command line (not left at their default)."""
    out = []
    for n in names:
        src = ctx.get_parameter_source(n)
        # by name: typer >= 0.20 vendors its own click, whose enum is not click's
        if src is not None and getattr(src, "name", "") not in ("DEFAULT", "DEFAULT_MAP"):
            out.append(n)
    return out


def _known_errors() -> tuple:
    from mla_tune.problem.workload import ProblemError
    from mla_tune.store.results import StoreError
    from mla_tune.validate import InputError
    from vllm_metax.tuned_config import TunedConfigError
    return (UserError, ProblemError, StoreError, TunedConfigError, InputError)


def main() -> None:
    """Console-script entry: user errors become one line; tracebacks only with MLA_TUNE_DEBUG=1."""
    try:
        rc = app(standalone_mode=False)   # without standalone mode, typer.Exit comes back as a code
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted; finished trials are stored")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        import click
        if isinstance(e, (click.exceptions.Abort, typer.Abort)):
            sys.exit(1)
        # typer >= 0.20 vendors click (typer._click): its usage errors are TyperExceptions
        if isinstance(e, (click.ClickException, typer.TyperException)):
            if e.format_message():     # empty when no arguments made typer print the help
                err_console.print(f"[bold red]error:[/] {escape(e.format_message())} (see --help)",
                                  highlight=False, soft_wrap=True)
            sys.exit(getattr(e, "exit_code", EXIT_USER_ERROR))
        if os.environ.get("MLA_TUNE_DEBUG"):
            raise
        if isinstance(e, _known_errors()):
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            sys.exit(EXIT_USER_ERROR)
        err_console.print(f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} "
                          "(set MLA_TUNE_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
        sys.exit(EXIT_FAILURE)
    sys.exit(rc if isinstance(rc, int) else 0)
