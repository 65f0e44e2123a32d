"""docs/cli.md from every command's --help, so the reference cannot go stale:

    python -m mla_tune.cli.docs > docs/cli.md

`tests/test_cli_docs.py` fails when the file differs from what this prints (as sqlite-utils'
docs test does)."""

from __future__ import annotations

HELP_WIDTH = 80

HEADER = """# mla-tune command reference

Generated from each command's `--help` by `python -m mla_tune.cli.docs > docs/cli.md`;
`tests/test_cli_docs.py` fails when this file is stale. Every command takes `-h`/`--help`;
`mla-tune --version` prints the version.

Every read command (`report`, `show`, `doctor`, `bench`) speaks one `--format`/`-f` vocabulary:
`table` (fits the terminal's width, or 80 columns in a pipe, else becomes a list with one line
per row), `json`, `csv`, `markdown`. Long work (`sweep`, `bench`) shows a progress bar on a
terminal and a progress line on stderr every few seconds otherwise. `--dry-run` (`sweep`,
`bench`, `emit`) checks everything and says what would run or be written, and does nothing.
"""


def help_text(args: list[str]) -> str:
    """`mla-tune ARGS --help` as printed at HELP_WIDTH columns."""
    from typer.testing import CliRunner

    from mla_tune.cli import app
    res = CliRunner().invoke(app, [*args, "--help"], prog_name="mla-tune",
                             terminal_width=HELP_WIDTH, env={"COLUMNS": str(HELP_WIDTH)})
    if res.exit_code != 0:
        raise RuntimeError(f"mla-tune {' '.join(args)} --help failed: {res.output}")
    return res.stdout.rstrip() + "\n"


def command_names() -> list[str]:
    from typer.main import get_command

    from mla_tune.cli import app
    return list(get_command(app).commands)


def old_spellings() -> dict[str, list[str]]:
    """Each old spelling a command still parses -> the commands that parse it (read from the
    commands themselves, so the section below cannot name an alias that does not exist)."""
    from typer.main import get_command

    from mla_tune.cli import app
    from mla_tune.cli.app import OLD_SPELLINGS
    out: dict[str, list[str]] = {}
    for name, command in get_command(app).commands.items():
        for param in command.params:
            for opt in getattr(param, "opts", ()):
                if opt in OLD_SPELLINGS:
                    out.setdefault(opt, []).append(name)
    return out


def old_spellings_section() -> str:
    from mla_tune.cli.app import OLD_SPELLINGS
    rows = "\n".join(f"| `{old}` | `{OLD_SPELLINGS[old]}` | {', '.join(cmds)} |"
                     for old, cmds in old_spellings().items())
    return ("## Flag names\n\nOne name per idea across commands. These older spellings still work "
            "for one release, only in the commands named, and are left out of `--help`:\n\n"
            "| old | now | accepted by |\n|---|---|---|\n" + rows + "\n")


def cli_markdown() -> str:
    parts = [HEADER, "## mla-tune\n", "```\n" + help_text([]) + "```\n"]
    for name in command_names():
        parts += [f"## mla-tune {name}\n", "```\n" + help_text([name]) + "```\n"]
    parts.append(old_spellings_section())
    return "\n".join(parts)


if __name__ == "__main__":
    import sys
    sys.stdout.write(cli_markdown())
