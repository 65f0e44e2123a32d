"""Output for people fits the width it is printed at (80 columns in a pipe or a CI log): a table
that fits stays a table, one that does not becomes a list, one line per row; no cell is folded
into a column a few characters wide."""

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.store.results import ResultsStore
from mla_tune.views.render import Column, FitTable, Table, to_rich
from mla_tune.views.report import build_report
from mla_tune.views.sweep_view import candidate_label, summary_tables
from results_fixture import build_fixture_db

runner = CliRunner()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_fixture_db(tmp_path_factory.mktemp("width") / "results.db")


def _printed(renderables, width=80) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def _fits(text: str, width=80) -> None:
    long = [ln for ln in text.splitlines() if len(ln) > width]
    assert not long, long[:3]


def test_a_table_that_fits_stays_a_table_and_one_that_does_not_becomes_a_list():
    narrow = Table("narrow", [Column("batch"), Column("name", justify="left")])
    narrow.add(1, "flashinfer/fa3/p64")
    wide = Table("wide", [Column(f"column {i}", justify="left") for i in range(8)])
    wide.add(*[f"value-{i}-" + "x" * 12 for i in range(8)])
    out = _printed(to_rich([narrow, wide]))
    _fits(out)
    assert "┃ batch ┃ name" in out and "flashinfer/fa3/p64" in out
    assert "- column 0 value-0-xxxxxxxxxxxx, column 1 value-1-xxxxxxxxxxxx" in out
    assert FitTable(narrow).fits(80) and not FitTable(wide).fits(80)


def test_prose_columns_may_wrap_but_names_never_fold():
    t = Table("why", [Column("candidate", justify="left"), Column("why", justify="left", wrap=True)])
    t.add("flashinfer/fa3/p64/kv_chunk=x0.25", "a long reason " * 8)
    out = _printed(to_rich([t]))
    _fits(out)
    assert "flashinfer/fa3/p64/kv_chunk=x0.25" in out and "┃ candidate" in out


@pytest.mark.parametrize("args", [[], ["--full"]])
def test_report_in_a_pipe_at_80_columns(fx, args):
    res = runner.invoke(app, ["report", "--db", str(fx.path), *args], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    _fits(res.stdout)
    if args:        # every candidate name whole on one line: nothing folded into narrow columns
        with ResultsStore(fx.path, create=False) as s:
            keys = {t["candidate"] for t in s.trials()}
        for k in keys:
            assert k in res.stdout, k


def test_sweep_summary_at_80_columns(fx):
    with ResultsStore(fx.path, create=False) as s:
        rep = build_report(s)
    gpu = next(d for d in rep.devices if not d.is_reference)
    out = _printed(to_rich(summary_tables(gpu.choice)))
    _fits(out)
    labels = {candidate_label(v.chosen) for m in gpu.choice.models for b in m.buckets
              for v in b.families.values() if v.chosen}
    for label in labels:        # each whole on one line, not folded into a narrow column
        assert label in out, label


def test_a_list_folds_between_its_pairs_and_no_line_ends_in_a_space():
    wide = Table("a title long enough to be folded at eighty columns, " * 2,
                 [Column(f"column {i}", justify="left") for i in range(8)],
                 caption="a caption long enough to be folded at eighty columns, " * 2)
    wide.add(*[f"value-{i}-" + "x" * 12 for i in range(8)])
    out = _printed(to_rich([wide]))
    _fits(out)
    assert not [ln for ln in out.splitlines() if ln.endswith(" ")]
    lines = out.splitlines()
    for i in range(8):          # every `name value` pair whole on one line
        assert any(f"column {i} value-{i}-" + "x" * 12 in ln for ln in lines), (i, out)
    assert sum(ln.startswith("- ") for ln in lines) == 1          # one item, folded lines indented
    assert all(ln.startswith("  ") for ln in lines[lines.index(next(
        ln for ln in lines if ln.startswith("- "))) + 1:] if ln and "caption" not in ln
               and "- " not in ln[:2] and "title" not in ln and "eighty" not in ln)


def test_an_empty_section_is_one_line_not_a_box():
    out = _printed(to_rich([Table("nothing here", [Column("batch"), Column("name")])]))
    assert out.splitlines() == ["nothing here", "(none)", ""]


@pytest.mark.parametrize("args", [[], ["--full"]])
def test_report_at_80_columns_has_no_trailing_spaces(fx, args):
    res = runner.invoke(app, ["report", "--db", str(fx.path), *args], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert not [ln for ln in res.stdout.splitlines() if ln != ln.rstrip()]


def test_the_shipped_summary_is_short_and_one_style_at_80_columns():
    """The shipped results.db (two GPUs, 4 model entries each, prefill): every fastest-per-bucket
    grid a table (not a table on one GPU and a list on the other), the whole summary a page
    per GPU, not 200 lines."""
    from pathlib import Path
    db = Path(__file__).resolve().parent.parent / "results.db"
    res = runner.invoke(app, ["report", "--db", str(db)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    out = res.stdout
    _fits(out)
    flat = " ".join(out.split())
    import re
    assert flat.count("fastest per bucket") == 4
    assert len(re.findall(r"┃\s+batch\s+┃\s+L1024", out)) == 4
    assert "- batch" not in out and "e+0" not in out
    assert len(out.splitlines()) <= 160, len(out.splitlines())


def test_report_into_a_closed_pipe_exits_0_quietly(fx):
    """`mla-tune report | head -1`: the reader leaves early; the command says nothing and exits
    0 (rich's own answer was exit 1; click's too)."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "mla_tune", "report", "--db", str(fx.path),
                          "--full"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**__import__("os").environ, "COLUMNS": "80"})
    p.stdout.close()              # the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0 and err == "", err


def test_a_prose_column_never_folds_a_word_in_two():
    """doctor's detail column at 80 columns: a class path stays whole (a list where it cannot)."""
    path = "vllm_metax.backend.flashinfer_mla.FlashInferMLABackendWithALongName"
    t = Table("Checks", [Column("check", justify="left"), Column("status", justify="left"),
                         Column("detail", justify="left", wrap=True)])
    t.add("platform plugin", "ok", f"would activate: {path} (a reason long enough to wrap)")
    t.add("device", "ok", "short")
    out = _printed(to_rich([t]))
    _fits(out)
    assert path in out
