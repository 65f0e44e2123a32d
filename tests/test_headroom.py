"""bench/headroom.py on the shipped H200 results.db: the fastest measured candidate per bucket,
read-only, checked against a direct query; bad inputs exit 2 with one line."""

from __future__ import annotations

import json
import shutil
import sqlite3
import statistics
from pathlib import Path

import pytest
from bench_support import load_bench

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_bench("headroom")


@pytest.fixture()
def db(tmp_path):
    path = tmp_path / "results.db"
    shutil.copy(ROOT / "results.db", path)
    return path


def _median_of(path, run, heads, batch, ctx, candidate):
    con = sqlite3.connect(path)
    vals = [v for (v,) in con.execute(
        "select s.value from samples s join trials t on t.id = s.trial_id join workloads w on w.id = t.workload_id "
        "where t.run_id = ? and t.candidate = ? and w.num_heads = ? and w.batch_size = ? and w.context_len = ? "
        "and w.ragged = 'uniform' and w.q_len = 1 and s.metric = 'kernel_us' and t.status = 'ok'",
        (run, candidate, heads, batch, ctx))]
    return statistics.median(vals)


def test_bests_match_a_direct_query_and_leave_the_db_alone(bench, db):
    before = db.read_bytes()
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    run = bench.newest_decode_run(con)
    bests = bench.bucket_bests(con, run)
    assert len(bests) >= 96
    for key in [(16, 1, 1024, "uniform"), (128, 64, 4096, "uniform")]:
        d = bests[key]
        assert d["default"] == pytest.approx(_median_of(db, run, *key[:3], bench.DEFAULT))
        best_us, cand = d["best"]
        assert best_us == pytest.approx(_median_of(db, run, *key[:3], cand))
        assert best_us == min(d["all"].values()) <= d["default"]
    # the split kernel is the fastest measured at 16 heads, one request, 1K tokens (the sweep's verdict)
    assert bests[(16, 1, 1024, "uniform")]["best"][1].startswith("split/")
    assert db.read_bytes() == before


def test_writes_the_bound_against_the_goals(bench, db, tmp_path, monkeypatch, capsys):
    # run 6: the shipped H200 sweep (results.db also holds the H100's, run 7)
    monkeypatch.setattr("sys.argv", ["headroom.py", "--db", str(db), "--run", "6", "--out", str(tmp_path / "out"),
                                     "--tuned-vs-auto", str(ROOT / "bench/results/tuned_vs_auto_h200.json")])
    assert bench.main() == 0
    text = (tmp_path / "out" / "headroom_h200.md").read_text()
    assert "| all | 104 |" in text and ">= 1.10x" in text
    rows = [line for line in text.splitlines() if line.startswith("| H")]
    assert len(rows) == 104
    ratios = [float(line.split(" | ")[3]) for line in rows]
    assert min(ratios) >= 1.0                       # the default itself is a candidate
    assert "Small work (B x L <= 8192 tokens, 20 buckets)" in capsys.readouterr().out


def test_bad_inputs_exit_2_with_one_line(bench, db, tmp_path, monkeypatch, capsys):
    def run(*argv):
        monkeypatch.setattr("sys.argv", ["headroom.py", *argv, "--out", str(tmp_path / "out")])
        return bench.main()
    assert run("--db", str(tmp_path / "missing.db")) == 2
    assert "is not a file" in capsys.readouterr().err
    junk = tmp_path / "junk.db"
    junk.write_text("not sqlite")
    assert run("--db", str(junk)) == 2
    assert "is not a results DB" in capsys.readouterr().err
    bad_json = tmp_path / "tva.json"
    bad_json.write_text(json.dumps({"rows": "no"}))
    assert run("--db", str(db), "--tuned-vs-auto", str(bad_json)) == 2
    assert "is not bench/tuned_vs_auto.py's JSON" in capsys.readouterr().err
    other = tmp_path / "other.db"
    shutil.copy(db, other)
    con = sqlite3.connect(other)
    con.execute("update runs set device_name = 'MetaX C500'")
    con.commit()
    con.close()
    assert run("--db", str(db), "--extra-db", str(other)) == 2
    assert "different devices" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
