"""The results DB's schema: its version and the migrations that bring an older DB up to it, one
small function per step, each applied in its own transaction and recorded in the meta table."""

from __future__ import annotations

import hashlib
import json

import sqlite_utils

from mla_tune.store.integrity import META_TABLE, parse_schema_version

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


def migrate(db: sqlite_utils.Database, version: int) -> None:
    """Bring `db` from schema `version` to SCHEMA_VERSION, one transaction per step."""
    for i in range(version, SCHEMA_VERSION):
        with db.conn:
            # several sweeps may open a new DB at once: the write lock first, then
            # look again whether another process has applied this step meanwhile
            db.conn.execute("begin immediate")
            if stored_version(db) > i:
                continue
            MIGRATIONS[i](db)
            db[META_TABLE].upsert({"key": "schema_version", "value": str(i + 1)}, pk="key")


def stored_version(db: sqlite_utils.Database) -> int:
    """The schema version `db` records (0: none yet)."""
    if META_TABLE not in db.table_names():
        return 0
    row = db.execute(f"select value from {META_TABLE} where key='schema_version'").fetchone()
    return parse_schema_version(row[0], "the results DB") if row else 0

