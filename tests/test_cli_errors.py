"""The app's one error mapping: a known library error raised inside any command is one red line
and its exit code; anything else is not swallowed."""

import pytest
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.cli.app import EXIT_FAILURE, EXIT_USER_ERROR, exit_code_of, known_errors
from mla_tune.tune.sweep.config import SweepError, SweepInputError

runner = CliRunner()


def _raise(exc):
    def f(*a, **k):
        raise exc
    return f


@pytest.mark.parametrize("cls", known_errors(), ids=lambda c: c.__name__)
def test_known_error_is_one_line_and_exit_code(monkeypatch, cls):
    monkeypatch.setattr("mla_tune.views.doctor.diagnose", _raise(cls("the reason, in one line")))
    res = runner.invoke(app, ["doctor"])
    assert isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == exit_code_of(cls("x"))
    assert res.output.strip().splitlines() == ["error: the reason, in one line"]


def test_exit_codes():
    assert exit_code_of(SweepError("nothing ran")) == EXIT_FAILURE
    assert exit_code_of(SweepInputError("bad flag")) == EXIT_USER_ERROR


def test_an_unknown_error_is_not_mapped(monkeypatch):
    monkeypatch.setattr("mla_tune.views.doctor.diagnose", _raise(RuntimeError("a bug")))
    res = runner.invoke(app, ["doctor"])
    assert isinstance(res.exception, RuntimeError) and res.exit_code == 1


def test_every_command_module_leaves_errors_to_the_app():
    """No command catches the library's errors itself (one mapping, in the app)."""
    import ast
    from pathlib import Path
    names = {c.__name__ for c in known_errors()} | {"_known"}
    cli = Path(__file__).resolve().parent.parent / "mla_tune" / "cli"
    caught = []
    for f in sorted(cli.glob("*_cmd.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                ids = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                caught += [f"{f.name}:{node.lineno} {n}" for n in ids & names]
    assert not caught, caught
