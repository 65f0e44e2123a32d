"""`mla-tune merge`: copy the measurements of other results DBs into one, idempotently.

Runs (environment records) and trials are matched by their uid (schema 3; for an older DB the
same content hash its migration gives them, see store.schema.row_uid), workloads by their key, so a
second merge of the same file adds nothing, and a copy of a DB merged back adds nothing. A trial
whose shared-study claim the target already holds (the same candidate answered by two workers of
one distributed sweep) is not copied. Runs are copied as they are: each keeps its own device and
host, and every later read (report, emit) keeps devices apart. Sources are opened read-only and
immutable, checked row by row before anything is written, and never modified.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mla_tune import fault_points
from mla_tune.store.errors import StoreError
from mla_tune.store.integrity import META_TABLE, check_rows, parse_schema_version
from mla_tune.store.results import ResultsStore
from mla_tune.store.schema import SCHEMA_VERSION, row_uid
from mla_tune.store.sqlite_file import check_sqlite_header, connect_readonly
from mla_tune.validate import check_distinct_paths

WORKLOAD_KEY = ("model", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "softmax_scale",
                "batch_size", "context_len", "q_len", "ragged", "seed", "q_dtype", "kv_dtype")


@dataclass
class MergeCount:
    """What one source added to the target, and what it already had."""

    source: Path
    runs: int = 0
    workloads: int = 0
    trials: int = 0
    samples: int = 0
    known_trials: int = 0          # already in the target (same uid): a merge done before
    claimed_elsewhere: int = 0     # the target holds another answer to the same claim
    devices: list = field(default_factory=list)


def open_source(path: str | Path) -> sqlite3.Connection:
    """A results DB opened read-only and immutable (nothing appears beside it, not even when the
    merge is refused), every row checked (store.integrity); StoreError, the file untouched, for
    anything else."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"no results DB at {p}")
    if p.is_dir():
        raise StoreError(f"{p} is a directory, not a results DB")
    if not p.is_file():        # a FIFO or a device: opening it could block forever
        raise StoreError(f"{p} is not a regular file, so not a results DB; left untouched")
    check_sqlite_header(p)
    conn = None
    try:
        conn = connect_readonly(p)
        tables = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
        if META_TABLE not in tables:
            raise StoreError(f"{p} is a SQLite file but not an mla-tune results DB "
                             f"(tables: {', '.join(sorted(tables)) or 'none'}); left untouched")
        row = conn.execute(f"select value from {META_TABLE} where key = 'schema_version'").fetchone()
        version = parse_schema_version(row[0], p) if row else 0
        if version > SCHEMA_VERSION:
            raise StoreError(f"{p} has schema version {version}, newer than this mla-tune understands "
                             f"({SCHEMA_VERSION}); upgrade mla-tune. Left untouched")
        if version == 0:
            raise StoreError(f"{p} holds no schema version, so it is not a whole results DB; "
                             "left untouched")
        check_rows(conn, p)
    except sqlite3.DatabaseError as e:
        if conn is not None:
            conn.close()
        raise StoreError(f"{p} cannot be read as a results DB ({e}); left untouched") from None
    except (StoreError, OSError) as e:
        if conn is not None:
            conn.close()
        if isinstance(e, OSError):
            raise StoreError(f"cannot read {p}: {e.strerror or e}") from None
        raise
    conn.row_factory = sqlite3.Row
    return conn


def _columns(conn, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"pragma table_info({table})")]


def merge_into(target: str | Path, sources: Sequence[str | Path]) -> list[MergeCount]:
    """Copy every source's runs, workloads, trials and samples that `target` lacks into it (one
    transaction per source); the target is created if missing. Raises StoreError for a source
    that is not a results DB (checked before anything is written) or is the target itself."""
    target = Path(target)
    for s in sources:        # however spelt: ./t.db, a symbolic or a hard link
        check_distinct_paths(("merge source", s), ("--db", target))
    conns = []
    try:
        for s in sources:                          # every source checked before the target is touched
            conns.append(open_source(s))
        with ResultsStore(target) as store:
            return [_merge_one(store, Path(s), c) for s, c in zip(sources, conns)]
    finally:
        for c in conns:
            c.close()


def _merge_one(store: ResultsStore, path: Path, src: sqlite3.Connection) -> MergeCount:
    dst = store.db.conn
    out = MergeCount(path)
    run_cols = [c for c in _columns(dst, "runs") if c != "id"]
    trial_cols = [c for c in _columns(dst, "trials") if c != "id"]
    w_cols = [c for c in _columns(dst, "workloads") if c != "id"]
    with dst:
        dst.execute("begin immediate")         # sweeps may be writing the target meanwhile
        run_map = {}
        for r in src.execute("select * from runs order by id"):
            r = dict(r)
            uid = r.get("uid") or row_uid("runs", r)
            hit = dst.execute("select id from runs where uid = ?", [uid]).fetchone()
            if hit:
                run_map[r["id"]] = hit[0]
                continue
            row = {c: r.get(c) for c in run_cols}
            row["uid"] = uid
            cur = dst.execute(f"insert into runs ({', '.join(row)}) values ({', '.join('?' * len(row))})",
                              list(row.values()))
            run_map[r["id"]] = cur.lastrowid
            out.runs += 1
            if r.get("device_name") not in out.devices:
                out.devices.append(r.get("device_name"))
        w_map = {}
        where = " and ".join(f"[{k}] is ?" for k in WORKLOAD_KEY)
        for w in src.execute("select * from workloads order by id"):
            w = dict(w)
            hit = dst.execute(f"select id from workloads where {where}", [w[k] for k in WORKLOAD_KEY]).fetchone()
            if hit:
                w_map[w["id"]] = hit[0]
                continue
            row = {c: w.get(c) for c in w_cols}
            cur = dst.execute(f"insert into workloads ({', '.join(row)}) values ({', '.join('?' * len(row))})",
                              list(row.values()))
            w_map[w["id"]] = cur.lastrowid
            out.workloads += 1
        for t in src.execute("select * from trials order by id"):
            t = dict(t)
            uid = t.get("uid") or row_uid("trials", t)
            if dst.execute("select 1 from trials where uid = ?", [uid]).fetchone():
                out.known_trials += 1
                continue
            claim = t.get("claim")
            if claim and dst.execute("select 1 from trials where claim = ?", [claim]).fetchone():
                out.claimed_elsewhere += 1
                continue
            row = {c: t.get(c) for c in trial_cols}
            row.update(uid=uid, run_id=run_map[t["run_id"]], workload_id=w_map[t["workload_id"]])
            cur = dst.execute(f"insert into trials ({', '.join(row)}) values ({', '.join('?' * len(row))})",
                              list(row.values()))
            samples = src.execute("select metric, idx, value from samples where trial_id = ? order by idx",
                                  [t["id"]]).fetchall()
            dst.executemany("insert into samples (trial_id, metric, idx, value) values (?, ?, ?, ?)",
                            [(cur.lastrowid, m, i, v) for m, i, v in samples])
            out.trials += 1
            out.samples += len(samples)
        fault_points.at("merge-copied", store.path)     # inserted, not yet committed
    return out


__all__ = ["MergeCount", "merge_into", "open_source"]
