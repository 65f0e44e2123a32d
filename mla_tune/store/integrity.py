"""What a results DB may hold, checked where it is read: its schema version, its tables and
columns, and every stored row (type, range, reference), naming the DB, table, row and column of
the first row that breaks a rule.

Every reader goes through here: `ResultsStore` checks a DB when it opens it (report, emit,
replay, a sweep's resume) and `mla-tune merge` checks each source before it writes anything.
The rules run as SQL over whole tables (one scan each, no Python per row), so checking the
20 MB results.db costs a fraction of a second; a stored workload is also checked by the problem
model itself (`Workload.from_row`), the rule the sweep stored it by.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from mla_tune.problem.prefill import LAYOUTS as PREFILL_LAYOUTS, PrefillWorkload
from mla_tune.problem.workload import ProblemError, Workload
from mla_tune.store.errors import StoreError
from vllm_metax.core.tuned_config import PAGE_SIZES

META_TABLE = "mla_tune_meta"
STATUSES = ("ok", "invalid")
INVALID_REASONS = ("compile", "runtime", "wrong_result", "unsupported", "timeout", "crash")
MAX_VERSION_DIGITS = 4


class DamagedStoreError(StoreError):
    """A results DB whose tables or rows break the store's rules; the message names the DB,
    table, row and column. The file is left untouched."""


def parse_schema_version(value, path) -> int:
    """The stored schema version: a small non-negative integer, else StoreError (never int()
    on whatever the row holds: a 5000-digit or negative text is refused, not computed with)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or not text.isascii() or not text.isdigit() or len(text) > MAX_VERSION_DIGITS:
        shown = repr(value)[:40] + ("..." if len(repr(value)) > 40 else "")
        raise StoreError(f"{path} has an unreadable schema version {shown} (table {META_TABLE}, "
                         "key schema_version); left untouched")
    return int(text)


# ---------------------------------------------------------------- column rules

@dataclass(frozen=True)
class Rule:
    """One column's rule: an SQL condition on `{c}` (the column) that every row must meet, what
    it means in words, and the type affinity the column must be declared with."""

    sql: str
    says: str
    affinity: str          # INTEGER, REAL or TEXT: what the schema declares (numeric: any number)
    by_value: bool = False  # depends on the value alone: checked once per distinct value (an index
                            # scan where one leads with the column, e.g. samples' trial_id, metric)


def _one_of(values) -> str:
    return "(" + ", ".join(repr(v) if isinstance(v, str) else str(int(v)) for v in values) + ")"


_NUM = "typeof({c}) in ('integer', 'real') and {c} >= 0 and {c} < 1e308"
ID = Rule("typeof({c}) = 'integer'", "an integer id", "INTEGER")
POSITIVE = Rule("typeof({c}) = 'integer' and {c} >= 1 and {c} < 4611686018427387904",
                "a positive integer", "INTEGER")
COUNT = Rule("typeof({c}) = 'integer' and {c} >= 0", "a non-negative integer", "INTEGER")
INT_OR_NULL = Rule("{c} is null or typeof({c}) = 'integer'", "an integer or NULL", "INTEGER")
FLAG = Rule("{c} is null or (typeof({c}) = 'integer' and {c} in (0, 1))", "0, 1 or NULL", "INTEGER")
NUMBER = Rule("typeof({c}) in ('integer', 'real') and abs({c}) < 1e308", "a finite number", "REAL")
MEASURE = Rule(_NUM, "a finite number >= 0", "REAL")
MEASURE_OR_NULL = Rule("{c} is null or (" + _NUM + ")", "a finite number >= 0 or NULL", "REAL")
NAME = Rule("typeof({c}) = 'text' and length(trim({c})) > 0", "a non-empty text", "TEXT")
TEXT_OR_NULL = Rule("{c} is null or typeof({c}) = 'text'", "a text or NULL", "TEXT")
MAX_PARAMS = 2000         # characters of a trial's knobs as JSON (a few short knobs in practice)
# CASE, not AND: SQLite may evaluate json_type() on text json_valid() refused, which raises
PARAMS = Rule("{c} is null or (typeof({c}) = 'text' and length({c}) <= %d and case when "
              "json_valid({c}) then json_type({c}) = 'object' and not exists "
              "(select 1 from json_each({c}) where type in ('object', 'array')) else 0 end)" % MAX_PARAMS,
              f"a JSON object of plain values (knob: value), at most {MAX_PARAMS} characters", "TEXT")
LENGTHS = Rule("{c} is null or (typeof({c}) = 'text' and case when json_valid({c}) then "
               "json_type({c}) = 'array' else 0 end)",
               "a JSON list of per-request lengths or NULL", "TEXT")


def _page_sizes() -> tuple:
    return PAGE_SIZES


def table_rules() -> dict[str, dict[str, Rule]]:
    """table -> column -> Rule, for every column a reader relies on (others are free)."""
    page = Rule(f"typeof({{c}}) = 'integer' and {{c}} in {_one_of(_page_sizes())}",
                f"a page size ({', '.join(map(str, _page_sizes()))})", "INTEGER")
    return {
        "runs": {
            "id": ID, "started_at": TEXT_OR_NULL, "kind": NAME, "device_name": NAME,
            "sm_count": INT_OR_NULL, "copy_gbps": MEASURE_OR_NULL, "matmul_tflops": MEASURE_OR_NULL,
            "command": TEXT_OR_NULL, "notes": TEXT_OR_NULL, "uid": TEXT_OR_NULL,
            **{k: TEXT_OR_NULL for k in ("driver", "cuda", "torch", "flashinfer", "vllm", "host",
                                         "python")},
        },
        "workloads": {
            "id": ID, "model": NAME, "num_heads": POSITIVE, "kv_lora_rank": POSITIVE,
            "qk_rope_head_dim": POSITIVE, "softmax_scale": NUMBER, "batch_size": POSITIVE,
            "context_len": POSITIVE, "q_len": POSITIVE, "ragged": NAME, "seed": INT_OR_NULL,
            "q_dtype": NAME, "kv_dtype": NAME, "total_kv_tokens": COUNT, "bytes": COUNT,
            "flops": COUNT, "seq_lens": LENGTHS,
        },
        "trials": {
            "id": ID,
            "run_id": Rule("typeof({c}) = 'integer' and exists (select 1 from runs where runs.id = {c})",
                           "the id of a stored run", "INTEGER"),
            "workload_id": Rule("typeof({c}) = 'integer' and exists "
                                "(select 1 from workloads where workloads.id = {c})",
                                "the id of a stored workload", "INTEGER"),
            "sweep": TEXT_OR_NULL, "family": NAME, "backend": NAME, "page_size": page,
            "params": PARAMS, "candidate": NAME,
            "status": Rule(f"{{c}} in {_one_of(STATUSES)}", " or ".join(STATUSES), "TEXT"),
            "invalid_reason": Rule(f"({{c}} is null and status = 'ok') or {{c}} in {_one_of(INVALID_REASONS)}",
                                   f"NULL for an ok trial, else one of {', '.join(INVALID_REASONS)}",
                                   "TEXT"),
            "message": TEXT_OR_NULL, "compile_s": MEASURE_OR_NULL, "max_rel_error": MEASURE_OR_NULL,
            "started_at": TEXT_OR_NULL, "finished_at": TEXT_OR_NULL, "is_default": FLAG,
            "uid": TEXT_OR_NULL, "claim": TEXT_OR_NULL,
        },
        "samples": {
            "trial_id": Rule("typeof({c}) = 'integer' and exists (select 1 from trials where trials.id = {c})",
                             "the id of a stored trial", "INTEGER", by_value=True),
            "metric": Rule(NAME.sql, NAME.says, "TEXT", by_value=True), "idx": COUNT, "value": MEASURE,
        },
    }


# the columns every schema since the first has (a later migration adds the others)
REQUIRED = {
    "runs": ("id", "kind", "device_name"),
    "workloads": ("id", "model", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "softmax_scale",
                  "batch_size", "context_len", "q_len", "ragged", "seed", "q_dtype", "kv_dtype",
                  "total_kv_tokens", "bytes", "flops"),
    "trials": ("id", "run_id", "workload_id", "family", "backend", "page_size", "params",
               "candidate", "status", "invalid_reason", "message"),
    "samples": ("trial_id", "metric", "idx", "value"),
}


def affinity(declared: str | None) -> str:
    """SQLite's type affinity of a declared column type (sqlite.org/datatype3.html 3.1)."""
    t = (declared or "").upper()
    if "INT" in t:
        return "INTEGER"
    if any(s in t for s in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if not t or "BLOB" in t:
        return "BLOB"
    if any(s in t for s in ("REAL", "FLOA", "DOUB")):
        return "REAL"
    return "NUMERIC"


def _fits(declared: str, wanted: str) -> bool:
    a = affinity(declared)
    if a == "BLOB":               # no declared type: values are stored as given (the rows are checked)
        return True
    if wanted == "TEXT":
        return a == "TEXT"
    return a in ("INTEGER", "REAL", "NUMERIC")


def _shown(v) -> str:
    if isinstance(v, bytes):
        return f"a {len(v)}-byte blob"
    if isinstance(v, str) and len(v) > 40:
        return repr(v[:40]) + f"... ({len(v)} characters)"
    if v is None:
        return "NULL"
    return repr(v)


def damaged(path, table: str, row, column: str, value, says: str) -> DamagedStoreError:
    """The one-line error for a row that breaks its column's rule."""
    return DamagedStoreError(f"{path} is damaged: table {table}, row {row}, column {column} holds "
                             f"{_shown(value)}, not {says}; left untouched (restore it from a copy, "
                             "or rerun the sweep into a new DB)")


def check_schema(conn: sqlite3.Connection, path) -> dict[str, list[str]]:
    """The store's four tables with their columns, each declared with a type its rule allows;
    table -> columns present. StoreError names what is missing or re-declared."""
    tables = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
    missing = [t for t in REQUIRED if t not in tables]
    if missing:
        raise DamagedStoreError(f"{path} is an incomplete results DB: it lacks the table"
                                f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}; left untouched")
    rules = table_rules()
    present = {}
    for table in REQUIRED:
        cols = {r[1]: r[2] for r in conn.execute(f"pragma table_info([{table}])")}
        lacking = [c for c in REQUIRED[table] if c not in cols]
        if lacking:
            raise DamagedStoreError(f"{path} is damaged: table {table} lacks the column"
                                    f"{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}; "
                                    "left untouched")
        for c, declared in cols.items():
            rule = rules[table].get(c)
            if rule is not None and not _fits(declared, rule.affinity):
                raise DamagedStoreError(f"{path} is damaged: table {table}, column {c} is declared "
                                        f"{declared or 'without a type'!s}, not {rule.affinity} "
                                        f"({rule.says}); left untouched")
        present[table] = list(cols)
    return present


def check_rows(conn: sqlite3.Connection, path, columns: dict[str, list[str]] | None = None) -> None:
    """Every row of the four tables meets its columns' rules, and every stored workload is one the
    problem model accepts; DamagedStoreError names the first row that does not."""
    columns = columns or check_schema(conn, path)
    rules = table_rules()
    for table in ("runs", "workloads", "trials", "samples"):
        key = "id" if "id" in columns[table] else "rowid"
        checked = [(c, r) for c, r in rules[table].items() if c in columns[table]]
        for per_value in (True, False):
            part = [(c, r) for c, r in checked if r.by_value == per_value]
            if not part:
                continue
            # coalesce: a condition on NULL is NULL (unknown), which must count as broken
            conds = [f"coalesce(({r.sql.format(c=f'[{c}]')}), 0)" for c, r in part]
            source = (f"(select distinct {', '.join(f'[{c}]' for c, _ in part)} from [{table}])"
                      if per_value else f"[{table}]")
            what = ", ".join(f"[{c}]" for c, _ in part) if per_value else key
            row = conn.execute(f"select {what} from {source} where not ({' and '.join(conds)}) "
                               "limit 1").fetchone()
            if row is None:
                continue
            if per_value:       # the first row holding those values
                row = conn.execute(f"select {key} from [{table}] where "
                                   + " and ".join(f"[{c}] is ?" for c, _ in part) + " limit 1",
                                   list(row)).fetchone()
            flags = conn.execute(f"select {', '.join(conds)} from [{table}] where {key} = ?",
                                 [row[0]]).fetchone()
            c, rule = next(cr for cr, ok in zip(part, flags) if not ok)
            value = conn.execute(f"select [{c}] from [{table}] where {key} = ?", [row[0]]).fetchone()[0]
            where = f"id {row[0]}" if key == "id" else f"rowid {row[0]}"
            raise damaged(path, table, where, c, value, rule.says)
    _check_workloads(conn, path, columns["workloads"])


def _check_workloads(conn: sqlite3.Connection, path, columns: list[str]) -> None:
    conn_factory = conn.row_factory
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute("select * from workloads order by id").fetchall()
    finally:
        conn.row_factory = conn_factory
    for r in map(dict, rows):
        try:
            if r["ragged"] in PREFILL_LAYOUTS:
                PrefillWorkload.from_row(r)
            else:
                Workload.from_row(r)
        except (ProblemError, ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
            why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            column = "seq_lens" if "length" in why and "seq_lens" in columns else "(the workload)"
            raise DamagedStoreError(f"{path} is damaged: table workloads, row id {r['id']}, column "
                                    f"{column}: {why}; left untouched (restore it from a copy, or "
                                    "rerun the sweep into a new DB)") from None


def params_of(text, path, trial_id) -> dict:
    """A trial's stored knobs (JSON object text; NULL is none), DamagedStoreError if unreadable
    (what SQL's json_valid lets through and Python does not: a 5000-digit number, deep nesting)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError, TypeError):
        value = None
    if not isinstance(value, dict):
        raise damaged(path, "trials", f"id {trial_id}", "params", text, PARAMS.says)
    return value


__all__ = ["DamagedStoreError", "check_rows", "check_schema", "parse_schema_version", "params_of",
           "table_rules"]
