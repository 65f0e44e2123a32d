"""The results store: one SQLite file (results.db) through sqlite-utils.

Every measurement references a run (the environment it was taken in) and a workload. A trial is
one candidate on one workload, with its status and, when invalid, the reason; its raw timing
samples go to `samples`, statistics are derived on read. WAL mode, one commit per trial, so a
killed sweep loses at most the trial in flight.

MLA prefill workloads (`mla_tune.problem.prefill`) share the workloads table, marked by their
layout in `ragged`; `trials()` returns decode trials unless asked for prefill ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import sqlite_utils

from mla_tune.problem.defaults import KERNEL_METRIC, PLAN_METRIC
from mla_tune.problem.prefill import LAYOUTS as PREFILL_LAYOUTS
from mla_tune.store.errors import StoreError
from mla_tune.store.integrity import (INVALID_REASONS, META_TABLE, STATUSES, DamagedStoreError,
                                      check_rows, params_of, parse_schema_version)
from mla_tune.store.records import StoredWorkload, TrialRecord, as_records
from mla_tune.validate import is_sqlite, own_kind

SCHEMA_VERSION = 4


def _m1_initial(db: sqlite_utils.Database) -> None:
    db["runs"].create({
        "id": int, "started_at": str, "kind": str, "device_name": str, "sm_count": int,
        "driver": str, "cuda": str, "torch": str, "flashinfer": str, "vllm": str, "host": str,
        "python": str, "copy_gbps": float, "matmul_tflops": float, "command": str, "notes": str,
    }, pk="id")
    db["workloads"].create({
        "id": int, "model": str, "num_heads": int, "kv_lora_rank": int, "qk_rope_head_dim": int,
        "softmax_scale": float, "batch_size": int, "context_len": int, "q_len": int, "ragged": str,
        "seed": int, "q_dtype": str, "kv_dtype": str, "total_kv_tokens": int, "bytes": int,
        "flops": int,
    }, pk="id")
    db["workloads"].create_index(
        ["model", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "softmax_scale", "batch_size",
         "context_len", "q_len", "ragged", "seed", "q_dtype", "kv_dtype"], unique=True)
    db["trials"].create({
        "id": int, "run_id": int, "workload_id": int, "sweep": str, "family": str, "backend": str,
        "page_size": int, "params": str, "candidate": str, "status": str, "invalid_reason": str,
        "message": str, "compile_s": float, "max_rel_error": float, "started_at": str,
        "finished_at": str,
    }, pk="id", foreign_keys=[("run_id", "runs", "id"), ("workload_id", "workloads", "id")])
    db["trials"].create_index(["workload_id", "candidate"])
    db["trials"].create_index(["sweep"])
    db["samples"].create({"trial_id": int, "metric": str, "idx": int, "value": float},
                         foreign_keys=[("trial_id", "trials", "id")])
    db["samples"].create_index(["trial_id", "metric"])


def _m2_trial_is_default(db: sqlite_utils.Database) -> None:
    # which candidate was the family's untuned default when measured: the baseline a winner must beat
    db["trials"].add_column("is_default", int)


def row_uid(table: str, row: dict) -> str:
    """A stable identity for a run or trial stored before uids existed: a hash of its content and
    id, so two copies of one DB agree (a merge of a copy adds nothing)."""
    keys = (("id", "started_at", "kind", "device_name", "host", "command", "torch", "python")
            if table == "runs" else
            ("id", "run_id", "workload_id", "candidate", "status", "started_at", "finished_at", "sweep"))
    text = json.dumps([table] + [row.get(k) for k in keys], default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def _m3_uids_and_claims(db: sqlite_utils.Database) -> None:
    # runs and trials get an identity that survives copying between DBs (`mla-tune merge`), and a
    # trial the key of the shared-study claim it answered (one stored trial per claim, however
    # many workers raced for it)
    db["runs"].add_column("uid", str)
    db["trials"].add_column("uid", str)
    db["trials"].add_column("claim", str)
    for table in ("runs", "trials"):
        db.conn.executemany(f"update {table} set uid = ? where id = ?",
                            [(row_uid(table, r), r["id"]) for r in db[table].rows])
        db[table].create_index(["uid"], unique=True)
    db["trials"].create_index(["claim"], unique=True)   # NULLs (no shared study) never collide


def _m4_workload_lengths(db: sqlite_utils.Database) -> None:
    # a ragged workload's per-request lengths, as measured (JSON): a recorded trace's cannot be
    # computed from its kind, and every reader rebuilds the exact batch from them; NULL for
    # uniform workloads and for those stored before (their kind gives their lengths)
    db["workloads"].add_column("seq_lens", str)


MIGRATIONS = [_m1_initial, _m2_trial_is_default, _m3_uids_and_claims, _m4_workload_lengths]   # index i brings the schema from version i to i + 1
assert len(MIGRATIONS) == SCHEMA_VERSION


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass
class Stats:
    n: int
    median: float
    mean: float
    stdev: float
    q1: float
    q3: float
    minimum: float

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0


def stats_of(values: list[float]) -> Stats | None:
    if not values:
        return None
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return Stats(len(v), statistics.median(v), statistics.fmean(v),
                 statistics.stdev(v) if len(v) > 1 else 0.0, q[0], q[2], v[0])


def readonly_uri(path: str | Path) -> str:
    """A SQLite URI that reads `path` without writing anything, side files included.

    mode=ro on a WAL database still creates <db>-wal and <db>-shm beside it and leaves them
    behind; with no writer around (no -wal file) the file is read as immutable, which touches
    nothing. A writer's (or a killed sweep's) -wal holds committed trials: then read through it
    (its side files exist already)."""
    p = Path(path)
    wal = p.with_name(p.name + "-wal").exists()
    return p.resolve().as_uri() + ("?mode=ro" if wal else "?mode=ro&immutable=1")


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    """`path` opened for reading only (readonly_uri). A DB with a -wal beside it in a folder this
    user cannot write (SQLite cannot make its -shm there) is read from a private snapshot of the
    DB and its WAL instead: reading never needs write access to the source's folder."""
    try:
        conn = sqlite3.connect(readonly_uri(path), uri=True, timeout=30)
        conn.execute("select count(*) from sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        p = Path(path)
        if not p.with_name(p.name + "-wal").exists():
            raise
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory(prefix="mla-tune-read-") as tmp:
        copy = Path(tmp) / "snapshot.db"
        shutil.copyfile(path, copy)
        shutil.copyfile(f"{path}-wal", f"{copy}-wal")
        disk = sqlite3.connect(str(copy), timeout=30)
        try:
            mem = sqlite3.connect(":memory:")
            disk.backup(mem)
        finally:
            disk.close()
    return mem


def remove_stale_temp_files(path: str | Path) -> None:
    """Delete what a sweep killed while creating `path` left beside it (_create_whole's private
    `.<name>.<pid>.<tag>.new` files and their side files), when the process that made them is gone."""
    p = Path(path)
    try:
        found = list(p.parent.glob(f".{p.name}.*.new*"))
    except OSError:
        return
    for f in found:
        pid = f.name[len(p.name) + 2:].split(".", 1)[0]
        if not pid.isascii() or not pid.isdigit() or len(pid) > 9 or _alive(int(pid)):
            continue
        try:
            f.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@own_kind("an mla-tune results DB")
def is_results_db(path: str | Path) -> bool:
    """An mla-tune results DB: SQLite holding the store's meta table (read without writing)."""
    if not is_sqlite(Path(path)):
        return False
    try:
        conn = connect_readonly(path)
        try:
            return conn.execute("select 1 from sqlite_master where type = 'table' and name = ?",
                                [META_TABLE]).fetchone() is not None
        finally:
            conn.close()
    except (sqlite3.Error, OSError):
        return False


def _migrate(db: sqlite_utils.Database, version: int) -> None:
    """Bring `db` from schema `version` to SCHEMA_VERSION, one transaction per step."""
    for i in range(version, SCHEMA_VERSION):
        with db.conn:
            # several sweeps may open a new DB at once: the write lock first, then
            # look again whether another process has applied this step meanwhile
            db.conn.execute("begin immediate")
            if _stored_version(db) > i:
                continue
            MIGRATIONS[i](db)
            db[META_TABLE].upsert({"key": "schema_version", "value": str(i + 1)}, pk="key")


def _stored_version(db: sqlite_utils.Database) -> int:
    if META_TABLE not in db.table_names():
        return 0
    row = db.execute(f"select value from {META_TABLE} where key='schema_version'").fetchone()
    return parse_schema_version(row[0], "the results DB") if row else 0



def check_sqlite_header(path: Path) -> None:
    """StoreError unless `path` (a regular file) starts with SQLite's header."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise StoreError(f"cannot read {path}: {e.strerror or e}") from None
    if head != b"SQLite format 3\x00":
        raise StoreError(f"{path} is not a SQLite file, so not a results DB; left untouched")

class ResultsStore:
    """Open (or create) a results DB. Raises StoreError, never alters a foreign or newer file.

    `create=False` opens an existing DB read-only (SQLite mode=ro): reading never writes, not
    even a schema or a journal-mode change."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        self.readonly = not create
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a directory, not a results DB")
        if self.path.exists() and not self.path.is_file():
            raise StoreError(f"{self.path} is not a regular file, so not a results DB; left untouched")
        if create:
            remove_stale_temp_files(self.path)
        if create and not self.path.exists():
            self._create_whole()
        exists = self.path.exists() and self.path.stat().st_size > 0
        if not exists and not create:
            what = "an empty file" if self.path.exists() else "no results DB"
            raise StoreError(f"{what} at {self.path} (run `mla-tune sweep` first)")
        if exists:
            check_sqlite_header(self.path)
        conn = None
        try:
            if exists and not self.readonly:
                # checked through a read-only connection first: a DB that is refused gets no
                # -wal or -shm beside it, whatever happens to this process
                probe = connect_readonly(self.path)
                try:
                    self._inspect(probe, exists)
                finally:
                    probe.close()
            conn = connect_readonly(self.path) if self.readonly else \
                sqlite3.connect(str(self.path), timeout=30)
            self.db = sqlite_utils.Database(conn)
            self._check_or_migrate(exists)
        except BaseException as e:
            if conn is not None:
                conn.close()
            if isinstance(e, sqlite3.Error):
                raise StoreError(f"{self.path} cannot be read as a results DB ({e}); left untouched") from None
            if isinstance(e, OSError):
                raise StoreError(f"cannot read {self.path}: {e.strerror or e}") from None
            raise

    def _create_whole(self) -> None:
        """A new DB appears at its path whole: built (WAL, every table, the schema version) in a
        private file beside it and hard-linked into place, which fails if the path exists by
        then. So a second sweep started at the same moment never sees a half-made file (a SQLite
        header without the meta table: what a foreign or empty SQLite file looks like, which is
        refused); the one that lost the race opens the winner's DB. Where the folder cannot take
        a hard link, or is not writable, the path is created in place as before."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.new")
        try:
            conn = sqlite3.connect(str(tmp), timeout=30)
            try:
                db = sqlite_utils.Database(conn)
                db.enable_wal()
                _migrate(db, 0)
            finally:
                conn.close()          # the last connection: the WAL is checkpointed into the file
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass                  # another sweep made it first: open that one
        except (OSError, sqlite3.Error):
            pass                      # no link here (or no write): created in place below
        finally:
            for side in ("", "-wal", "-shm"):
                try:
                    os.unlink(f"{tmp}{side}")
                except OSError:
                    pass

    def _inspect(self, conn: sqlite3.Connection, existed: bool) -> int:
        """The DB's schema version, every refusal raised first: a foreign or newer file, an
        unreadable version, a damaged table or row (store.integrity)."""
        tables = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
        if existed and tables and META_TABLE not in tables:
            raise StoreError(f"{self.path} is a SQLite file but not an mla-tune results DB "
                             f"(tables: {', '.join(sorted(tables))}); left untouched")
        version = 0
        if META_TABLE in tables:
            row = conn.execute(f"select value from {META_TABLE} where key='schema_version'").fetchone()
            version = parse_schema_version(row[0], self.path) if row else 0
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} has schema version {version}, newer than this mla-tune "
                             f"understands ({SCHEMA_VERSION}); upgrade mla-tune. Left untouched")
        if version == 0 and self.readonly:
            raise StoreError(f"{self.path} is not an mla-tune results DB of schema "
                             f"{SCHEMA_VERSION} (found no schema); reading commands leave it "
                             "untouched")
        if version or (existed and tables):
            # every row checked before anything reads or writes it (a migration included)
            check_rows(conn, self.path)
        return version

    def _check_or_migrate(self, existed: bool) -> None:
        if self.readonly or not existed:
            version = self._inspect(self.db.conn, existed)
        else:
            version = self._stored_version()      # inspected through the probe
        if self.readonly:
            if version < SCHEMA_VERSION:
                # an older DB (the shipped results.db is schema 2): read an upgraded copy in
                # memory, never the file (a sweep into it upgrades the file)
                mem = sqlite3.connect(":memory:")
                self.db.conn.backup(mem)
                self.db.conn.close()
                self.db = sqlite_utils.Database(mem)
                _migrate(self.db, version)
            return
        if version < SCHEMA_VERSION:
            self.db.enable_wal()
            _migrate(self.db, version)
        elif self.db.journal_mode != "wal":
            self.db.enable_wal()

    def _stored_version(self) -> int:
        return _stored_version(self.db)

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def db_uid(self) -> str:
        """This DB's identity, made once (a copy keeps it): a sweep's studies in a journal file
        belong to one results DB, so a new DB next to an old journal starts afresh."""
        row = self.db.execute(f"select value from {META_TABLE} where key = 'db_uid'").fetchone()
        if row:
            return row[0]
        with self.db.conn:
            self.db.conn.execute(f"insert or ignore into {META_TABLE} (key, value) values ('db_uid', ?)",
                                 [uuid.uuid4().hex])
        return self.db.execute(f"select value from {META_TABLE} where key = 'db_uid'").fetchone()[0]

    @property
    def schema_version(self) -> int:
        return int(self.db[META_TABLE].get("schema_version")["value"])

    # ------------------------------------------------------------ writes
    def add_run(self, env: dict) -> int:
        cols = {c.name for c in self.db["runs"].columns}
        row = {k: v for k, v in env.items() if k in cols and k != "id"}
        extra = {k: v for k, v in env.items() if k not in cols}
        if extra:
            row["notes"] = json.dumps(extra, default=str)
        row.setdefault("started_at", _now())
        row.setdefault("uid", uuid.uuid4().hex)
        with self.db.conn:
            return self.db["runs"].insert(row).last_pk

    def workload_id(self, workload, bytes_: int, flops: int) -> int:
        key = dict(workload.key)
        with self.db.conn:
            self.db.conn.execute("begin immediate")   # another sweep may be adding it right now
            rows = list(self.db["workloads"].rows_where(
                " and ".join(f"[{k}] = ?" for k in key), list(key.values()), limit=1))
            if rows:
                return rows[0]["id"]
            return self.db["workloads"].insert(
                {**key, "total_kv_tokens": workload.total_kv_tokens, "bytes": bytes_, "flops": flops,
                 "seq_lens": workload.lengths_json()}
            ).last_pk

    def add_trial(self, run_id: int, workload_id: int, candidate, status: str,
                  samples: dict[str, list[float]] | None = None, invalid_reason: str | None = None,
                  message: str = "", compile_s: float | None = None,
                  max_rel_error: float | None = None, sweep: str = "",
                  started_at: str | None = None, is_default: bool | None = None,
                  claim: str | None = None) -> int:
        """Store one finished trial and its samples in one transaction. A trial answering a
        shared-study `claim` that is already stored is not stored again: the stored one's id
        comes back."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} not in {STATUSES}")
        if status == "invalid" and invalid_reason not in INVALID_REASONS:
            raise ValueError(f"invalid_reason {invalid_reason!r} not in {INVALID_REASONS}")
        row = {
            "run_id": run_id, "workload_id": workload_id, "sweep": sweep,
            "family": candidate.family, "backend": candidate.backend,
            "page_size": candidate.page_size, "params": json.dumps(candidate.params, sort_keys=True),
            "candidate": candidate.key, "status": status, "invalid_reason": invalid_reason,
            "message": (message or "")[:2000], "compile_s": compile_s, "max_rel_error": max_rel_error,
            "started_at": started_at or _now(), "finished_at": _now(),
            "is_default": None if is_default is None else int(bool(is_default)),
            "uid": uuid.uuid4().hex, "claim": claim,
        }
        conn = self.db.conn
        with conn:   # the trial and its samples commit together or not at all
            cur = conn.execute(
                f"insert or ignore into trials ({', '.join(row)}) values ({', '.join('?' * len(row))})",
                list(row.values()))
            if cur.rowcount == 0:    # this claim was answered by another worker already
                return conn.execute("select id from trials where claim = ?", [claim]).fetchone()[0]
            tid = cur.lastrowid
            conn.executemany(
                "insert into samples (trial_id, metric, idx, value) values (?, ?, ?, ?)",
                [(tid, metric, i, float(v)) for metric, values in (samples or {}).items()
                 for i, v in enumerate(values)])
        return tid

    # ------------------------------------------------------------ reads
    def samples(self, trial_id: int, metric: str = KERNEL_METRIC) -> list[float]:
        return [r[0] for r in self.db.execute(
            "select value from samples where trial_id = ? and metric = ? order by idx",
            [trial_id, metric]).fetchall()]

    def trial_candidates(self, ids) -> dict[int, str]:
        """trial id -> candidate key, of those of `ids` stored here."""
        ids, out = list(ids), {}
        for i in range(0, len(ids), 900):
            chunk = ids[i:i + 900]
            out.update(self.db.execute(f"select id, candidate from trials where id in "
                                       f"({','.join('?' * len(chunk))})", chunk).fetchall())
        return out

    def claimed(self, claims: list[str]) -> dict[str, dict]:
        """claim -> the stored trial row (with samples) that answered it, for the given claims."""
        claims = [c for c in claims if c]
        if not claims:
            return {}
        rows = self.trials(f"t.claim in ({','.join('?' * len(claims))})", claims)
        return {r["claim"]: r for r in rows}

    def trials(self, where: str = "1=1", args: Iterable = (), prefill: bool = False) -> list[dict]:
        """Trials joined with their workload and run, with kernel-time statistics derived here:
        decode trials, or with `prefill` the MLA prefill trials (never both: the choices differ)."""
        layouts = ", ".join(f"'{x}'" for x in PREFILL_LAYOUTS)
        where = f"({where}) and {'' if prefill else 'not '}(coalesce(w.ragged, '') in ({layouts}))"
        sql = f"""
            select t.*, w.model, w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.softmax_scale,
                   w.batch_size, w.context_len, w.q_len, w.ragged, w.seed, w.q_dtype, w.kv_dtype,
                   w.total_kv_tokens, w.bytes, w.flops, w.seq_lens, r.device_name, r.kind as run_kind,
                   r.copy_gbps, r.matmul_tflops
            from trials t join workloads w on t.workload_id = w.id join runs r on t.run_id = r.id
            where {where} order by t.id"""
        rows = [dict(r) for r in self.db.query(sql, list(args))]
        ids = [r["id"] for r in rows]
        by_trial: dict = {}
        for i in range(0, len(ids), 900):
            chunk = ids[i:i + 900]
            q = f"select trial_id, metric, value from samples where trial_id in ({','.join('?' * len(chunk))}) order by trial_id, idx"
            for tid, metric, value in self.db.execute(q, chunk).fetchall():
                by_trial.setdefault(tid, {}).setdefault(metric, []).append(value)
        for r in rows:
            r["params"] = params_of(r["params"], self.path, r["id"])
            r["samples"] = by_trial.get(r["id"], {})
            r["stats"] = stats_of(r["samples"].get(KERNEL_METRIC, []))
            r["plan_stats"] = stats_of(r["samples"].get(PLAN_METRIC, []))
        return rows

    def records(self, where: str = "1=1", args: Iterable = (), prefill: bool = False) -> list[TrialRecord]:
        """`trials(where, args, prefill)` as typed TrialRecords (workload, candidate, samples)."""
        return as_records(self.trials(where, args, prefill))

    def workloads(self, where: str = "1=1", args: Iterable = ()) -> list[StoredWorkload]:
        """The stored workloads (alias w) matching `where`, in id order."""
        return [StoredWorkload.from_row(dict(r)) for r in self.db.query(
            f"select * from workloads w where {where} order by w.id", list(args))]

    def runs(self) -> list[dict]:
        """Run records, with the environment keys that have no column of their own (kept as
        JSON in `notes`) merged in."""
        out = []
        for r in self.db["runs"].rows_where(order_by="id"):
            try:
                extra = json.loads(r.get("notes") or "{}")
            except ValueError:
                extra = {}
            out.append({**(extra if isinstance(extra, dict) else {}), **r})
        return out
