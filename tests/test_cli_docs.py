"""docs/cli.md is every command's --help, regenerated and compared (as sqlite-utils does): a flag
added, renamed or re-worded without `python -m mla_tune.cli.docs > docs/cli.md` fails here."""

from pathlib import Path

from mla_tune.cli.docs import cli_markdown, command_names

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_current():
    current = (ROOT / "docs" / "cli.md").read_text()
    assert current == cli_markdown(), (
        "docs/cli.md is stale: run `python -m mla_tune.cli.docs > docs/cli.md`")


def test_every_command_has_a_section():
    text = (ROOT / "docs" / "cli.md").read_text()
    names = command_names()
    assert {"sweep", "report", "emit", "show", "bench", "doctor", "merge"} <= set(names)
    for name in names:
        assert f"## mla-tune {name}\n" in text and f"Usage: mla-tune {name} " in text, name
