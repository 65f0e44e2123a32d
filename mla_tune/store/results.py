"""The results store: one SQLite file (results.db) through sqlite-utils.

Every measurement references a run (the environment it was taken in) and a workload. A trial is
one candidate on one workload, with its status and, when invalid, the reason; its raw timing
samples go to `samples`, statistics are derived on read. WAL mode, one commit per trial, so a
killed sweep loses at most the trial in flight.

MLA prefill workloads (`mla_tune.problem.prefill`) share the workloads table, marked by their
layout in `ragged`; `trials()` returns decode trials unless asked for prefill ones.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Iterable

import sqlite_utils

from mla_tune import fault_points
from mla_tune.problem.defaults import KERNEL_METRIC, PLAN_METRIC
from mla_tune.problem.prefill import LAYOUTS as PREFILL_LAYOUTS
from mla_tune.store.errors import StoreError
from mla_tune.store.integrity import (INVALID_REASONS, META_TABLE, STATUSES, check_rows, params_of,
                                      parse_schema_version)
from mla_tune.store.records import StoredWorkload, TrialRecord, as_records
from mla_tune.store.schema import SCHEMA_VERSION, migrate, stored_version
from mla_tune.store.sqlite_file import check_sqlite_header, connect_readonly, remove_stale_temp_files
from mla_tune.store.stats import stats_of


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class ResultsStore:
    """Open (or create) a results DB. Raises StoreError, never alters a foreign or newer file.

    `create=False` opens an existing DB read-only (SQLite mode=ro): reading never writes, not
    even a schema or a journal-mode change."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        self.readonly = not create
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a directory, not a results DB")
        if self.path.is_symlink() and not self.path.exists():
            # SQLite would follow it and create the target, somewhere the user never named
            raise StoreError(f"{self.path} is a symbolic link to {os.readlink(self.path)}, which "
                             "does not exist; name the DB file itself (or remove the link): "
                             "nothing is created through it")
        if self.path.exists() and not self.path.is_file():
            raise StoreError(f"{self.path} is not a regular file, so not a results DB; left untouched")
        if create:
            remove_stale_temp_files(self.path)
        if create and not self.path.exists():
            self._create_whole()
            fault_points.at("db-created", self.path)
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
            self._check_ormigrate(exists)
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
                migrate(db, 0)
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

    def _check_ormigrate(self, existed: bool) -> None:
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
                migrate(self.db, version)
            return
        if version < SCHEMA_VERSION:
            self.db.enable_wal()
            migrate(self.db, version)
        elif self.db.journal_mode != "wal":
            self.db.enable_wal()

    def _stored_version(self) -> int:
        return stored_version(self.db)

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
        fault_points.at("trial-stored", self.path)
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

    @staticmethod
    def _kind(where: str, prefill: bool) -> str:
        """`where` narrowed to decode trials, or with `prefill` to the MLA prefill trials (alias w:
        their workload)."""
        layouts = ", ".join(f"'{x}'" for x in PREFILL_LAYOUTS)
        return f"({where}) and {'' if prefill else 'not '}(coalesce(w.ragged, '') in ({layouts}))"

    def trial_count(self, prefill: bool = False) -> int:
        """How many decode trials (or with `prefill` MLA prefill trials) the DB holds, nothing loaded."""
        return self.db.execute("select count(*) from trials t join workloads w on t.workload_id = w.id "
                               f"where {self._kind('1=1', prefill)}").fetchone()[0]

    def trials(self, where: str = "1=1", args: Iterable = (), prefill: bool = False) -> list[dict]:
        """Trials joined with their workload and run, with kernel-time statistics derived here:
        decode trials, or with `prefill` the MLA prefill trials (never both: the choices differ)."""
        where = self._kind(where, prefill)
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
