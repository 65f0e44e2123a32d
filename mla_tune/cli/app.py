"""The Typer app, the shared console, and how errors reach the user (one line, non-zero exit)."""

from __future__ import annotations

import errno
import os
import sys
from enum import Enum

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from vllm_metax.core.profile import PROFILE_ENV, PROFILE_NAMES


# Old flag spellings, kept working for one release (0.2 drops them) but left out of --help and
# docs/cli.md: old -> new. One name per idea across commands (docs/cli.md, "Flag names").
OLD_SPELLINGS = {
    "--batch": "--batches",          # bench (sweep's name)
    "--context": "--contexts",       # bench (sweep's name)
    "--ragged": "--lengths",         # bench, sweep
    "--out": "--configs-dir",        # emit (sweep's name)
}


def _hide_old_spellings(command) -> None:
    """Leave OLD_SPELLINGS out of each option's help line; parsing still accepts them."""
    for param in getattr(command, "params", ()):
        # by name: typer >= 0.20 vendors its own click, whose Option is not click's
        if param.param_type_name != "option" or not set(param.opts) & set(OLD_SPELLINGS):
            continue

        def help_record(ctx, _p=param, _record=type(param).get_help_record):
            shown, _p.opts = _p.opts, [o for o in _p.opts if o not in OLD_SPELLINGS]
            try:
                return _record(_p, ctx)
            finally:
                _p.opts = shown
        param.get_help_record = help_record


def _conventional_usage(command) -> None:
    """Arguments on the usage line as click and most CLIs write them (`FILE`, `CANDIDATE...`,
    `[SOURCES]...`), not typer 0.29's `{file}` and `{CANDIDATE...}...`."""
    for param in getattr(command, "params", ()):
        if param.param_type_name != "argument":
            continue

        def usage(_p=param) -> str:
            name = _p.metavar or _p.name.upper()
            if _p.nargs != 1 and not name.endswith("..."):
                name += "..."
            return name if _p.required else f"[{name}]"
        param._usage_display_name = usage          # what typer's usage line asks each argument


class Commands(TyperGroup):
    """The app's command group: where the library's known errors become one red line and an exit
    code, for every command (the commands themselves catch nothing)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        for command in self.commands.values():
            _hide_old_spellings(command)
            _conventional_usage(command)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except known_errors() as e:
            if os.environ.get("MLA_TUNE_DEBUG"):
                raise
            fail(str(e), exit_code_of(e))
        except BrokenPipeError:
            # the reader closed the pipe (`report | head`): it has what it asked for, so no message
            # and exit 0, as `head` gives (click would exit 1 here, and `-f csv | head -1`, all
            # in one write, exits 0)
            from mla_tune import faults
            faults.silence_stdout()
            raise typer.Exit(0) from None


app = typer.Typer(
    name="mla-tune",
    cls=Commands,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain click help: help text is never read as rich markup ("[/k=v]" is text), and it wraps
    # to the terminal's width in one column of options instead of rich's boxed panels
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from mla_tune import __version__
        typer.echo(f"mla-tune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    """Tune MLA decode attention (FlashInfer, Triton MLA, split-KV) on this GPU; emit the config
    the vllm_metax plugin loads. Start with `mla-tune sweep`, then `mla-tune report`."""
class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich's own answer is SystemExit(1); a closed pipe is the reader's choice (`| head`), not
        # a failure: raise it where Commands.invoke and main() turn it into a quiet exit 0
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader closed the pipe")


console = _Console()
err_console = Console(stderr=True)

# The target profiles (vllm_metax.core.profile) as a Typer choice: --profile on every command
# that measures or writes a config for a target.
ProfileName = Enum("ProfileName", {n: n for n in PROFILE_NAMES}, type=str)


def profile_option(what: str, default: str = ""):
    """The --profile option; `what` says what it does, `default` what it is when not given."""
    default = default or f"${PROFILE_ENV}, else the device's: metax on a MetaX GPU"
    return typer.Option(None, "--profile", case_sensitive=False,
                        help=f"Target profile, {' or '.join(PROFILE_NAMES)}: {what} (default: "
                             f"{default})")


def profile_value(value) -> str | None:
    """A --profile value as the library takes it (None: not given)."""
    return getattr(value, "value", value)

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


def known_errors() -> tuple:
    """The library's errors that mean "this input cannot be used" (or, for a sweep, "nothing could
    be measured"): shown as their one-line message, never as a traceback."""
    from mla_tune.problem.workload import ProblemError
    from mla_tune.store.errors import StoreError
    from mla_tune.store.selection import SelectionError
    from mla_tune.tune.study_storage import StorageError
    from mla_tune.tune.emit import EmitError
    from mla_tune.tune.prefill import PrefillSweepError
    from mla_tune.tune.sweep.config import SweepError
    from mla_tune.validate import InputError
    from mla_tune.views.report import ReportError
    from vllm_metax.core.tuned_config import TunedConfigError
    return (UserError, InputError, ProblemError, StoreError, SelectionError, StorageError,
            SweepError, EmitError, ReportError, TunedConfigError, PrefillSweepError)


def exit_code_of(error: Exception) -> int:
    """2 for bad input; 1 for a job that ran and failed (a sweep that could not measure)."""
    from mla_tune.tune.sweep.config import SweepError
    if isinstance(error, SweepError) and not isinstance(error, ValueError):
        return EXIT_FAILURE
    return EXIT_USER_ERROR


def print_view(out) -> None:
    """A rendered view: text as is, rich renderables through the console."""
    if isinstance(out, str):
        typer.echo(out, nl=not out.endswith("\n"))
    else:
        for r in out:
            console.print(r)


def _exit(code: int):
    """Exit with `code` once standard output is flushed; a write that fails there (a full disk,
    /dev/full) is one line and exit 1, not an interpreter message at exit."""
    from mla_tune import faults
    try:
        faults.flush_stdout()
    except OSError as e:
        faults.silence_stdout()
        if e.errno == errno.EPIPE:       # `mla-tune report | head`: the reader has all it wanted
            sys.exit(code)
        err_console.print(f"[bold red]error:[/] cannot write the output: {escape(faults.describe(e))}",
                          highlight=False, soft_wrap=True)
        sys.exit(EXIT_FAILURE)
    sys.exit(code)


def main() -> None:
    """Console-script entry: user errors become one line; tracebacks only with MLA_TUNE_DEBUG=1."""
    from mla_tune import faults
    if faults.stdout_closed():
        err_console.print("[bold red]error:[/] standard output is closed, so nothing could be shown; "
                          "run it again with output open (e.g. > out.txt)", highlight=False,
                          soft_wrap=True)
        sys.exit(EXIT_USER_ERROR)
    try:
        rc = app(standalone_mode=False)   # without standalone mode, typer.Exit comes back as a code
    except typer.Exit as e:
        _exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted; finished trials are stored")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        import click
        if isinstance(e, (click.exceptions.Abort, typer.Abort)):
            sys.exit(1)
        # a bare `mla-tune` asks what the tool does: the help on stdout, exit 0 (click >= 8.2
        # makes it a usage error, exit 2); by name, as typer itself tells it from its vendored click
        if type(e).__name__ == "NoArgsIsHelpError":
            typer.echo(e.ctx.get_help())
            _exit(0)
        # typer >= 0.20 vendors click (typer._click): its usage errors are TyperExceptions
        if isinstance(e, (click.ClickException, typer.TyperException)):
            if e.format_message():     # empty when no arguments made typer print the help
                err_console.print(f"[bold red]error:[/] {escape(e.format_message())} (see --help)",
                                  highlight=False, soft_wrap=True)
            sys.exit(getattr(e, "exit_code", EXIT_USER_ERROR))
        if os.environ.get("MLA_TUNE_DEBUG"):
            raise
        if isinstance(e, known_errors()):     # raised outside a command (while parsing)
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            sys.exit(exit_code_of(e))
        if faults.is_fault(e):                # a full disk, a read-only folder, a closed output
            if isinstance(e, OSError) and e.errno == errno.EPIPE:     # as Commands.invoke
                faults.silence_stdout()
                sys.exit(0)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EBADF) and e.filename is None:
                faults.silence_stdout()       # most likely the output itself
            err_console.print(f"[bold red]error:[/] {escape(faults.describe(e))}", highlight=False,
                              soft_wrap=True)
            sys.exit(EXIT_FAILURE)
        err_console.print(f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} "
                          "(set MLA_TUNE_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
        sys.exit(EXIT_FAILURE)
    _exit(rc if isinstance(rc, int) else 0)
