"""The README's first commands stay true: CI runs its test command, and every CLI command is documented."""

import re
from pathlib import Path

from typer.main import get_command

from mla_tune.cli import app

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_first_two_commands_install_run_and_test():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    main, tests = blocks[0], blocks[1]
    assert "mla-tune sweep" in main and "pip install" in main
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text(), "CI must run the README's test command verbatim"


def test_every_command_is_documented():
    readme = (ROOT / "README.md").read_text()
    names = sorted(get_command(app).commands)
    assert {"sweep", "report", "emit", "show", "bench", "doctor"} <= set(names)
    missing = [n for n in names if f"mla-tune {n}" not in readme]
    assert not missing, f"commands missing from README: {missing}"
