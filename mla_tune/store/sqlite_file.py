"""A results DB as a file: what a path holds (a SQLite file, an mla-tune results DB), reading it
without writing anything beside it, and the temporary files a killed sweep left when creating it."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from mla_tune.faults import process_alive
from mla_tune.store.errors import StoreError
from mla_tune.store.integrity import META_TABLE
from mla_tune.validate import is_sqlite, own_kind


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
    """`path` opened for reading only (readonly_uri), never writing a byte beside it.

    A -wal beside it (a live writer's, or a killed one's: it holds committed trials) in a folder
    this user cannot write is read from a private snapshot of the DB and its WAL instead: SQLite
    in mode=ro still rebuilds the WAL index in a -shm it can open for writing (the folder's
    permission does not stop that), and immutable=1 would read the DB without the WAL's
    trials. Reading never needs, nor uses, write access to the source's folder."""
    p = Path(path)
    wal = p.with_name(p.name + "-wal")
    if wal.exists() and not os.access(p.parent, os.W_OK):
        return _snapshot(p, wal)
    try:
        conn = sqlite3.connect(readonly_uri(path), uri=True, timeout=30)
        conn.execute("select count(*) from sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        if not wal.exists():
            raise
    return _snapshot(p, wal)


def _snapshot(db: Path, wal: Path) -> sqlite3.Connection:
    """The DB with its WAL applied, in memory, read from private copies (the copies are SQLite's
    to recover; the originals are only read). Copied again if either file changed meanwhile (a
    writer checkpointing between the two copies)."""

    def stamp():
        return tuple((s.st_size, s.st_mtime_ns) for s in (db.stat(), wal.stat()))
    for _ in range(5):
        try:
            before = stamp()
        except FileNotFoundError:
            if db.exists() and not wal.exists():    # the writer closed: its WAL is in the DB now
                return sqlite3.connect(readonly_uri(db), uri=True, timeout=30)
            raise
        with tempfile.TemporaryDirectory(prefix="mla-tune-read-") as tmp:
            copy = Path(tmp) / "snapshot.db"
            shutil.copyfile(db, copy)
            try:
                shutil.copyfile(wal, f"{copy}-wal")
                if stamp() != before:
                    continue
            except FileNotFoundError:
                continue
            disk = sqlite3.connect(str(copy), timeout=30)
            try:
                mem = sqlite3.connect(":memory:")
                disk.backup(mem)
            finally:
                disk.close()
            return mem
    raise sqlite3.OperationalError(f"{db} kept changing while it was read (a sweep writing it?); "
                                   "try again")


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
        if not pid.isascii() or not pid.isdigit() or len(pid) > 9 or process_alive(int(pid)):
            continue
        try:
            f.unlink()
        except OSError:
            pass


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


def check_sqlite_header(path: Path) -> None:
    """StoreError unless `path` (a regular file) starts with SQLite's header."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise StoreError(f"cannot read {path}: {e.strerror or e}") from None
    if head != b"SQLite format 3\x00":
        raise StoreError(f"{path} is not a SQLite file, so not a results DB; left untouched")

