"""`mla-tune merge`: idempotent, device- and host-preserving, read-only on its sources."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.store.merge import merge_into
from mla_tune.store.results import ResultsStore, StoreError
from results_fixture import H200, METAX, build_fixture_db

runner = CliRunner()
SHIPPED = Path(__file__).parent / "data" / "results_schema2_h200.db"   # the 2026-12-02 H200 sweep, schema 2


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def content(db: Path) -> list:
    """Every trial with what identifies it across DBs and its samples (ids differ between DBs)."""
    with ResultsStore(db, create=False) as s:
        rows = s.trials()
        runs = {r["id"]: (r["device_name"], r.get("host"), r["uid"]) for r in s.runs()}
    return sorted((runs[r["run_id"]], r["uid"], r["model"], r["num_heads"], r["batch_size"],
                   r["context_len"], r["candidate"], r["status"], json.dumps(r["samples"], sort_keys=True))
                  for r in rows)


def only_device(src: Path, dst: Path, device: str) -> Path:
    """A copy of `src` holding one device's runs and trials (what that device's host would have)."""
    shutil.copy(src, dst)
    with closing(sqlite3.connect(dst)) as c, c:
        c.execute("delete from samples where trial_id in (select t.id from trials t join runs r on "
                  "t.run_id = r.id where r.device_name != ?)", [device])
        c.execute("delete from trials where run_id in (select id from runs where device_name != ?)", [device])
        c.execute("delete from runs where device_name != ?", [device])
    return dst


def test_merge_of_per_device_dbs_is_the_union_and_idempotent(tmp_path):
    fx = build_fixture_db(tmp_path / "all.db")
    a = only_device(fx.path, tmp_path / "h200.db", H200)
    b = only_device(fx.path, tmp_path / "metax.db", METAX)
    before = {p: digest(p) for p in (a, b)}
    target = tmp_path / "merged.db"
    res = runner.invoke(app, ["merge", str(a), str(b), "--db", str(target)])
    assert res.exit_code == 0, res.output
    assert "trials" in res.output and H200 in res.output and METAX in res.output
    merged = content(target)
    assert merged == sorted(content(a) + content(b))                  # nothing lost, nothing doubled
    assert {d for (d, _, _), *_ in merged} == {H200, METAX}
    # again: nothing is added
    res = runner.invoke(app, ["merge", str(a), str(b), "--db", str(target)])
    assert res.exit_code == 0 and "0 trials" in res.output and "already in" in res.output, res.output
    assert content(target) == merged
    assert {p: digest(p) for p in (a, b)} == before                   # sources never modified
    # runs keep their device and host, one record each
    with ResultsStore(target, create=False) as s:
        hosts = sorted((r["device_name"], r["host"]) for r in s.runs())
    with ResultsStore(fx.path, create=False) as s:
        assert hosts == sorted((r["device_name"], r["host"]) for r in s.runs() if r["device_name"] != "cpu")


def test_emit_after_merge_writes_one_config_per_device_never_mixed(tmp_path):
    fx = build_fixture_db(tmp_path / "all.db")
    a = only_device(fx.path, tmp_path / "h200.db", H200)
    b = only_device(fx.path, tmp_path / "metax.db", METAX)
    target = tmp_path / "merged.db"
    merge_into(target, [a, b])
    out = tmp_path / "cfg"
    res = runner.invoke(app, ["emit", "--db", str(target), "--all-devices", "--out", str(out)])
    assert res.exit_code == 0, res.output
    files = sorted(f.name for f in out.iterdir())
    assert files == ["device_name=MetaX_C500.json", "device_name=NVIDIA_H200.json"]
    for name, single in (("device_name=NVIDIA_H200.json", a), ("device_name=MetaX_C500.json", b)):
        alone = tmp_path / f"alone-{single.stem}"
        res = runner.invoke(app, ["emit", "--db", str(single), "--out", str(alone)])
        assert res.exit_code == 0, res.output
        got, want = (json.loads((d / name).read_text()) for d in (out, alone))
        assert got["device_name"] == want["device_name"]
        assert got["models"] == want["models"]             # the merged DB decides as the device's own


def test_a_copy_of_an_old_schema_db_merged_into_its_migrated_copy_adds_nothing(tmp_path):
    # the shipped results.db (schema 2): one copy opened (so migrated), one left as it was
    old, new = tmp_path / "old.db", tmp_path / "new.db"
    shutil.copy(SHIPPED, old)
    shutil.copy(SHIPPED, new)
    with ResultsStore(new) as s:
        n = len(s.trials())
    before = digest(old)
    counts = merge_into(new, [old])
    assert (counts[0].trials, counts[0].runs, counts[0].known_trials) == (0, 0, n)
    assert digest(old) == before


def test_merge_of_two_sweeps_adds_the_others_trials(tmp_path):
    from mla_tune.tune.sweep.run import run_sweep
    from mla_tune.tune.sweep.request import SweepRequest
    dbs = []
    for i, batches in enumerate(("1", "2")):
        db = tmp_path / f"host{i}.db"
        run_sweep(SweepRequest(db=db, device="cpu", isolation="inline", emit=False, batches=batches,
                               contexts="64", page_size=[16, 64], samples=3, warmup=1).config())
        dbs.append(db)
    counts = merge_into(dbs[0], [dbs[1]])
    assert counts[0].trials == 2 and counts[0].runs == 1
    with ResultsStore(dbs[0], create=False) as s:
        assert sorted(r["batch_size"] for r in s.trials()) == [1, 1, 2, 2] and len(s.runs()) == 2
    assert merge_into(dbs[0], [dbs[1]])[0].trials == 0


def test_a_claim_answered_twice_is_kept_once(tmp_path):
    # two hosts of one distributed sweep both answered a claim (a worker thought dead that was not)
    from mla_tune.families.base import Candidate
    from mla_tune.problem.workload import Workload
    w = Workload(16, 512, 64, 0.1, batch_size=4, context_len=1024)
    dbs = []
    for i in range(2):
        with ResultsStore(tmp_path / f"h{i}.db") as s:
            run = s.add_run({"kind": "gpu", "device_name": H200, "host": f"host{i}"})
            wid = s.workload_id(w, 1, 2)
            s.add_trial(run, wid, Candidate.parse("flashinfer/fa3/p64"), "ok", {"kernel_us": [1.0 + i] * 3},
                        claim="study-uid|flashinfer/fa3/p64")
            s.add_trial(run, wid, Candidate.parse("flashinfer/fa2/p64"), "ok", {"kernel_us": [2.0] * 3})
        dbs.append(tmp_path / f"h{i}.db")
    counts = merge_into(dbs[0], [dbs[1]])
    assert (counts[0].trials, counts[0].claimed_elsewhere) == (1, 1)
    with ResultsStore(dbs[0], create=False) as s:
        assert sorted(r["candidate"] for r in s.trials()) == ["flashinfer/fa2/p64"] * 2 + ["flashinfer/fa3/p64"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("notes\n"), "not a SQLite file"),
    (lambda p: sqlite3.connect(p).execute("create table x (a)").connection.commit(), "not an mla-tune results DB"),
    (lambda p: None, "no results DB at"),
    (lambda p: p.mkdir(), "is a directory"),
])
def test_foreign_sources_are_refused_in_one_line_and_nothing_is_written(tmp_path, make, message):
    src = tmp_path / "other.db"
    make(src)
    before = digest(src) if src.is_file() else None
    target = tmp_path / "results.db"
    res = runner.invoke(app, ["merge", str(src), "--db", str(target)])
    assert res.exit_code == 2 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not target.exists()                                     # checked before the target is opened
    if before:
        assert digest(src) == before


def test_merging_a_db_into_itself_is_refused(tmp_path):
    fx = build_fixture_db(tmp_path / "r.db")
    before = content(fx.path)
    res = runner.invoke(app, ["merge", str(fx.path), "--db", str(fx.path)])
    assert res.exit_code == 2 and "are one file" in res.output
    assert content(fx.path) == before


def test_a_newer_schema_source_is_refused(tmp_path):
    fx = build_fixture_db(tmp_path / "new.db")
    with closing(sqlite3.connect(fx.path)) as c, c:
        c.execute("update mla_tune_meta set value = '99' where key = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 99"):
        merge_into(tmp_path / "t.db", [fx.path])
