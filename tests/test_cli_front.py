"""The CLI's front door (#38): help that renders for every command at 80 columns, -h, --version,
one flag name per idea (old spellings hidden but working), --dry-run, bench's CPU defaults."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner
from typer.main import get_command

from cli_support import run_main
from mla_tune.cli import app
from mla_tune.cli.app import OLD_SPELLINGS

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
COMMANDS = list(get_command(app).commands)


def _help(*args, width=80, flag="--help"):
    return runner.invoke(app, [*args, flag], prog_name="mla-tune", terminal_width=width,
                         env={"COLUMNS": str(width)})


def test_bench_help_does_not_crash_on_its_own_text():
    # through the console script's main(), which turned the MarkupError into "internal error"
    res = run_main(["bench", "--help"])
    assert res.code == 0 and res.exception is None, res.output
    assert "internal error" not in res.output
    assert "family/backend/p<page>[/knob=value]" in res.stdout     # the text rich read as markup


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_fits_80_columns(command):
    res = _help(*([command] if command else []))
    assert res.exit_code == 0, res.output
    long = [ln for ln in res.stdout.splitlines() if len(ln) > 80]
    assert not long, long
    assert "╭" not in res.stdout and "…" not in res.stdout      # no boxed panels, no cut-off text


@pytest.mark.parametrize("command", [None, "sweep", "report"])
def test_dash_h_is_help(command):
    args = [command] if command else []
    short = _help(*args, flag="-h")
    assert short.exit_code == 0 and short.stdout == _help(*args).stdout
    assert "-h, --help" in short.stdout


def test_version_is_the_package_version():
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    res = run_main(["--version"])
    assert res.code == 0 and res.stdout.strip() == f"mla-tune {want}"


def test_sweep_help_is_short_and_names_the_real_default_families():
    from mla_tune.tune.sweep.config import GPU_FAMILIES
    out = _help("sweep").stdout
    assert len(out.splitlines()) < 130
    flat = " ".join(out.split())
    assert f"default: GPU {', '.join(GPU_FAMILIES)}" in flat and "split" in GPU_FAMILIES


def test_old_spellings_are_hidden_from_every_help():
    for command in COMMANDS:
        out = _help(command).stdout
        for old in OLD_SPELLINGS:
            assert not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", out), (command, old)


def test_one_name_per_idea_across_commands():
    opts = {c: {o for p in get_command(app).commands[c].params for o in getattr(p, "opts", ())}
            for c in COMMANDS}
    assert {"--batches", "--contexts", "--lengths"} <= opts["bench"] & opts["sweep"]
    assert "--configs-dir" in opts["emit"] & opts["sweep"]
    fmt = {c for c in COMMANDS if "--format" in opts[c]}
    assert fmt == {"report", "show", "doctor", "bench"}
    assert all("-f" in opts[c] for c in fmt)


def _bench_plan(tmp_path, *args):
    res = run_main(["bench", "reference/torch/p64", "--device", "cpu", "--dry-run", "-f", "json",
                    *args], cwd=tmp_path)
    assert res.code == 0, res.output
    return json.loads(res.stdout)


def test_bench_old_and_new_spellings_parse_the_same(tmp_path):
    new = _bench_plan(tmp_path, "--batches", "2,4", "--contexts", "64", "--lengths", "lognormal")
    old = _bench_plan(tmp_path, "--batch", "2,4", "--context", "64", "--ragged", "lognormal")
    assert new == old and new["workloads"] == ["H16 B2 L64 lognormal", "H16 B4 L64 lognormal"]


def test_bench_defaults_on_cpu_are_small_and_never_results_db(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    plan = _bench_plan(tmp_path)
    assert plan["db"] == "results-cpu.db" and plan["samples"] == 10
    assert plan["workloads"] == ["H16 B1 L1024"]
    assert list(tmp_path.iterdir()) == []                  # a dry run writes nothing
    res = run_main(["bench", "reference/torch/p16", "--heads", "2", "--batches", "1", "--contexts",
                    "16", "--samples", "2"], cwd=tmp_path)
    assert res.code == 0, res.output
    assert (tmp_path / "results-cpu.db").exists() and not (tmp_path / "results.db").exists()
    assert "bench: 1/1 workloads" in res.stderr           # progress, as lines in a pipe
    assert "CPU torch reference" in res.stdout and "decide nothing" in res.stdout


def test_sweep_dry_run_plans_and_writes_nothing(tmp_path):
    res = run_main(["sweep", "--dry-run", "--batches", "4", "--contexts", "256", "--ragged",
                    "zipf"], cwd=tmp_path)
    assert res.code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "H16 B4 L256 zipf" in out and "Dry run: nothing measured, nothing written" in out
    assert list(tmp_path.iterdir()) == []


def test_emit_configs_dir_old_spelling_and_dry_run(tmp_path):
    from results_fixture import H200, build_fixture_db
    fx = build_fixture_db(tmp_path / "r.db")
    for flag in ("--configs-dir", "--out"):
        res = run_main(["emit", "--db", fx.path, flag, tmp_path / "c", "--device", H200,
                        "--dry-run"])
        assert res.code == 0, res.output
        assert f"would write {tmp_path / 'c'}/device_name=NVIDIA_H200.json" in res.stdout
        assert "nothing written" in res.stdout and not (tmp_path / "c").exists()
    res = run_main(["emit", "--db", fx.path, "--out", tmp_path / "c", "--device", H200])
    assert res.code == 0 and (tmp_path / "c" / "device_name=NVIDIA_H200.json").exists()


def test_line_progress_prints_every_few_seconds_not_every_update():
    import io

    from rich.console import Console

    from mla_tune.cli.progress import LineProgress
    now = [0.0]
    buf = io.StringIO()
    p = LineProgress(Console(file=buf, width=200), "sweep", 100, "trials", every=5.0,
                     clock=lambda: now[0])
    for i in range(1, 101):
        now[0] = i * 0.5                         # 50 s of work, an update every half second
        p.update(advance=1, note=f"B{i}")
    p.close()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "sweep: 0/100 trials, 0:00"
    assert 10 <= len(lines) <= 12, lines         # start, one per 5 s, end
    assert lines[-1] == "sweep: 100/100 trials, 0:50, B100"
    assert "eta 0:45" in lines[1]                # 10 of 100 done after 5 s


def test_a_bare_mla_tune_prints_the_help_and_exits_0():
    res = run_main([])
    assert res.code == 0 and res.exception is None, res.output
    assert res.stdout.startswith("Usage: ") and "COMMAND [ARGS]" in res.stdout
    assert "Commands:" in res.stdout
    assert res.stderr == "" and "error" not in res.output


def test_importing_the_cli_imports_no_kernel_or_plotting_library():
    """`mla-tune --help` and `--version` answer before torch could load (it takes seconds):
    the commands import what they measure or plot when they run."""
    import subprocess
    import sys
    heavy = ["torch", "optuna", "matplotlib", "scipy", "vllm", "flashinfer", "triton"]
    code = f"import sys, mla_tune.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_flag_names_section_names_only_aliases_a_command_parses():
    from mla_tune.cli.docs import old_spellings
    found = old_spellings()
    assert set(found) == set(OLD_SPELLINGS)          # every kept spelling still parses somewhere
    assert found["--batch"] == ["bench"] and found["--out"] == ["emit"]
    res = run_main(["sweep", "--batch", "4", "--dry-run"])
    assert res.code == 2 and "No such option" in res.stderr


def test_help_describes_every_option_with_a_capital_and_no_giant_range():
    for name, command in get_command(app).commands.items():
        for p in command.params:
            if p.param_type_name != "option" or p.hidden:
                continue
            assert p.help, (name, p.opts)
            assert p.help[0].isupper() or p.help[0] in "`$-", (name, p.opts, p.help[:30])
    for command in COMMANDS:
        out = _help(command).stdout
        assert "9223372036854775807" not in out and "{" not in out.splitlines()[0], command


def test_usage_lines_name_arguments_as_clis_do():
    assert _help("show").stdout.startswith("Usage: mla-tune show [OPTIONS] FILE\n")
    assert _help("bench").stdout.startswith("Usage: mla-tune bench [OPTIONS] CANDIDATE...\n")
    assert _help("merge").stdout.startswith("Usage: mla-tune merge [OPTIONS] SOURCES...\n")


@pytest.mark.parametrize("batches", ["1-100", "3-64", "2-48"])
def test_a_range_that_is_not_powers_of_two_is_refused_not_cut(tmp_path, batches):
    res = run_main(["sweep", "--dry-run", "--batches", batches], cwd=tmp_path)
    assert res.code == 2 and res.stdout == "" and "not one" in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1
    assert "1-64" in run_main(["sweep", "--dry-run", "--batches", "1-100"]).stderr


def test_the_dry_run_says_one_count_when_every_bucket_has_the_same():
    res = run_main(["sweep", "--dry-run", "--batches", "1", "--contexts", "256"])
    assert res.code == 0, res.output
    flat = " ".join(res.stdout.split())
    import re
    assert re.search(r", \d+ candidates each", flat) and not re.search(r"\d+-\d+ candidates", flat)


def test_a_cpu_sweep_names_one_winner_in_its_progress_and_its_table(tmp_path):
    """The CPU reference has no chosen page: its table names each bucket's fastest page, the
    candidate its progress line called best."""
    import re
    from results_fixture import build_fixture_db
    fx = build_fixture_db(tmp_path / "r.db")
    res = run_main(["sweep", "--replay", fx.path, "--device-name", "cpu"])
    assert res.code == 0, res.output
    flat = " ".join(res.stdout.split())
    best = re.findall(r"L(\d+): grid \S+ \(\d+ measured\) best reference/torch/p(\d+) ([\d.]+) us", flat)
    assert best
    rep = run_main(["report", "--db", fx.path, "--device", "cpu"])
    assert rep.code == 0, rep.output
    for ctx, page, t in best:       # the report's CPU grid names the same candidate and time
        assert re.search(rf"\b{ctx} │ torch p{page} {re.escape(t)} us", res.stdout), (ctx, page, t)
        assert f"ref p{page} {t}" in rep.stdout, (ctx, page, t)
