"""`mla-tune bench` through the CLI runner, on the CPU reference family."""

import json

from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.store.results import ResultsStore

runner = CliRunner()


def _invoke(args):
    # a Typer app with a single registered command runs it without its name
    prefix = ["bench"] if len(app.registered_commands) > 1 else []
    return runner.invoke(app, prefix + args)


def test_bench_stores_trials_and_prints_table(tmp_path):
    db = tmp_path / "r.db"
    res = _invoke(["reference/torch/p16", "reference/torch/p1", "flashinfer/fa3/p64", "--heads", "2",
                   "--batch", "2", "--context", "40", "--samples", "4", "--rounds", "2",
                   "--device", "cpu", "--db", str(db)])
    assert res.exit_code == 0, res.output
    assert "stored 3 trial(s)" in res.output
    with ResultsStore(db) as s:
        trials = s.trials()
    by = {t["candidate"]: t for t in trials}
    assert by["reference/torch/p16"]["status"] == "ok" and len(by["reference/torch/p16"]["samples"]["kernel_us"]) == 4
    assert by["flashinfer/fa3/p64"]["status"] == "invalid"
    assert by["flashinfer/fa3/p64"]["invalid_reason"] == "unsupported"
    assert all(t["sweep"] == "bench" for t in trials)


def test_bench_json(tmp_path):
    res = _invoke(["reference/torch/p4", "--heads", "2", "--batch", "1,2", "--context", "16",
                   "--samples", "2", "--device", "cpu", "--no-store", "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["trials"]     # progress lines go to stderr
    assert [r["workload"] for r in rows] == ["H2 B1 L16", "H2 B2 L16"]
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in rows)


def test_bench_bad_input_is_one_line_error(tmp_path):
    for args in (["nonsense"], ["reference/torch/p4", "--batch", "x"], ["nofamily/x/p4"],
                 ["reference/torch/p4", "--ragged", "zipff"]):
        res = _invoke(args + ["--device", "cpu", "--db", str(tmp_path / "r.db")])
        # exit 2 through the app's error mapping, not an exception escaping the command
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert "Traceback" not in res.output and "error:" in res.output
    assert not (tmp_path / "r.db").exists()
