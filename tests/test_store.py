import sqlite3

import pytest
import sqlite_utils

from mla_tune.families.base import Candidate
from mla_tune.problem.workload import Workload
from mla_tune.problem.defaults import PLAN_METRIC
from mla_tune.store.records import TrialRecord, as_records
from mla_tune.store.errors import StoreError
from mla_tune.store.integrity import META_TABLE
from mla_tune.store.results import ResultsStore
from mla_tune.store.schema import SCHEMA_VERSION
from mla_tune.store.stats import stats_of

W = Workload(16, 512, 64, 0.1, batch_size=4, context_len=1024)


def _trial(store, cand="reference/torch/p16", samples=(3.0, 1.0, 2.0), status="ok", reason=None):
    run = store.add_run({"kind": "cpu-reference", "device_name": "cpu", "torch": "x", "unknown_key": 5})
    wid = store.workload_id(W, 100, 200)
    return store.add_trial(run, wid, Candidate.parse(cand), status,
                           {"kernel_us": list(samples)} if samples else None, invalid_reason=reason)


def test_schema_and_roundtrip(tmp_path):
    path = tmp_path / "r.db"
    with ResultsStore(path) as s:
        tid = _trial(s)
        assert s.schema_version == SCHEMA_VERSION
        assert s.samples(tid) == [3.0, 1.0, 2.0]
        row = s.trials()[0]
        assert row["stats"].median == 2.0 and row["stats"].n == 3
        assert row["batch_size"] == 4 and row["device_name"] == "cpu"
        assert s.runs()[0]["unknown_key"] == 5 and s.runs()[0]["kind"] == "cpu-reference"
    db = sqlite_utils.Database(path)
    assert {"runs", "workloads", "trials", "samples", "mla_tune_meta"} <= set(db.table_names())
    assert db.journal_mode == "wal"


def test_records_are_typed_at_the_store_boundary(tmp_path):
    with ResultsStore(tmp_path / "r.db") as s:
        tid = _trial(s, cand="reference/torch/p16/x=1")
        _trial(s, status="invalid", reason="unsupported", samples=None)
        ok, bad = s.records()
        assert isinstance(ok, TrialRecord) and ok.id == tid and ok.workload == W
        assert ok.candidate == Candidate.parse("reference/torch/p16/x=1") and ok.key == ok.candidate.key
        assert ok.candidate.params == {"x": 1} and ok.values() == (3.0, 1.0, 2.0)
        assert ok.stats().median == 2.0 and ok.stats(PLAN_METRIC) is None and ok.device_name == "cpu"
        assert ok.stored.bucket == (4, 1024, 1) and ok.stored.total_kv_tokens == 4096
        assert ok.is_default is None and ok.run_kind == "cpu-reference"
        assert not bad.ok and bad.invalid_reason == "unsupported" and bad.stats() is None
        assert bad.stored is ok.stored                          # one per workload id
        assert as_records(s.trials()) == s.records()             # the old rows convert the same
        assert [w.problem for w in s.workloads()] == [W]
        assert s.records(prefill=True) == []                     # decode trials only, as trials()
        with pytest.raises(Exception):
            ok.status = "invalid"                               # frozen


def test_a_stored_workload_this_version_refuses_is_kept_without_its_problem(tmp_path):
    with ResultsStore(tmp_path / "r.db") as s:
        _trial(s)
        row = s.trials()[0]
    rec = TrialRecord.from_row({**row, "ragged": "from-the-future"})
    assert rec.workload is None and rec.stored.ragged == "from-the-future" and rec.stats().n == 3


def test_reopen_does_not_duplicate_workloads(tmp_path):
    path = tmp_path / "r.db"
    with ResultsStore(path) as s:
        a = s.workload_id(W, 1, 2)
    with ResultsStore(path) as s:
        assert s.workload_id(W, 1, 2) == a


def test_invalid_trial_needs_reason(tmp_path):
    with ResultsStore(tmp_path / "r.db") as s:
        with pytest.raises(ValueError):
            _trial(s, status="invalid", reason="nonsense")
        tid = _trial(s, status="invalid", reason="unsupported", samples=None)
        assert s.trials()[0]["invalid_reason"] == "unsupported" and s.trials()[0]["stats"] is None
        assert tid


def test_not_sqlite_left_untouched(tmp_path):
    p = tmp_path / "notes.db"
    p.write_bytes(b"hello world, not a database\n")
    with pytest.raises(StoreError, match="not a SQLite file"):
        ResultsStore(p)
    assert p.read_bytes() == b"hello world, not a database\n"


def test_a_new_db_appears_whole_and_a_sweep_that_lost_the_race_opens_the_winners(tmp_path, monkeypatch):
    # two sweeps started at once on a new DB: one saw the other's half-made file (a SQLite header,
    # no meta table yet) and refused it as foreign (CI, test_distributed). Now the path only ever
    # holds a whole DB: what is linked into place already has the meta table and the schema
    import os
    from mla_tune.store import sqlite_file as r
    p = tmp_path / "new.db"
    linked, real_link = [], os.link

    def link(src, dst):
        whole = r.is_results_db(src)
        if not linked:                    # this sweep's link; the other one wins just before it
            linked.append(None)
            with ResultsStore(p) as other:
                other.db["note"].insert({"by": "winner"})
        linked.append((whole, os.path.exists(dst)))
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    with ResultsStore(p) as store:        # the loser opens the winner's DB, nothing replaced
        assert store.db[META_TABLE].exists() and list(store.db["note"].rows) == [{"by": "winner"}]
    # each linked a whole DB; the winner found the path free, the loser found it taken
    assert linked == [None, (True, False), (True, True)]
    assert sorted(x.name for x in tmp_path.iterdir() if not x.name.startswith("new.db")) == []  # no private file left
    assert r.is_results_db(p)


def test_foreign_sqlite_left_untouched(tmp_path):
    p = tmp_path / "other.db"
    c = sqlite3.connect(p)
    c.execute("create table users (id int)")
    c.commit()
    c.close()
    before = p.read_bytes()
    with pytest.raises(StoreError, match="not an mla-tune results DB"):
        ResultsStore(p)
    assert p.read_bytes() == before


def test_newer_schema_refused(tmp_path):
    p = tmp_path / "r.db"
    with ResultsStore(p) as s:
        s.db["mla_tune_meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION + 1)}, pk="key")
    before = p.read_bytes()
    with pytest.raises(StoreError, match="newer"):
        ResultsStore(p)
    assert p.read_bytes() == before


def test_missing_db_for_read(tmp_path):
    with pytest.raises(StoreError, match="no results DB"):
        ResultsStore(tmp_path / "none.db", create=False)
    assert not (tmp_path / "none.db").exists()


def test_directory_refused(tmp_path):
    with pytest.raises(StoreError, match="directory"):
        ResultsStore(tmp_path)


def test_stats():
    s = stats_of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s.median == 3.0 and s.minimum == 1.0 and s.q1 == 2.0 and s.q3 == 4.0
    assert s.spread == pytest.approx(2 / 3)
    assert stats_of([]) is None


def test_candidate_key_roundtrip():
    c = Candidate("triton", "triton", 16, {"num_kv_splits": 8, "variant": "x"})
    assert Candidate.parse(c.key) == c and Candidate.parse(c.key).params == {"num_kv_splits": 8, "variant": "x"}
    for bad in ("flashinfer", "flashinfer/fa3/64", "a/b/p16/novalue"):
        with pytest.raises(ValueError):
            Candidate.parse(bad)


def test_an_older_schema_is_read_through_an_upgraded_copy_and_left_byte_for_byte(tmp_path):
    """A schema-2 results.db (the 2026-12-02 H200 sweep): reading commands see it upgraded (in memory) and the
    file, its folder and its side files stay as they were."""
    import hashlib
    import shutil
    from pathlib import Path
    src = Path(__file__).resolve().parent / "data" / "results_schema2_h200.db"   # 2026-12-02 H200 sweep
    db = tmp_path / "old.db"
    shutil.copy(src, db)
    from mla_tune.store.sqlite_file import readonly_uri
    c = sqlite3.connect(readonly_uri(db), uri=True)
    old = int(c.execute("select value from mla_tune_meta where key='schema_version'").fetchone()[0])
    c.close()
    assert old < SCHEMA_VERSION
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    s = ResultsStore(db, create=False)
    assert s._stored_version() == SCHEMA_VERSION
    assert s.db["trials"].count > 3000
    s.close()
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.db"]
