"""A results DB as a file: what a path holds (a SQLite file, an mla-tune results DB), reading it
without writing anything beside it, and the temporary files a killed sweep left when creating it."""

from __future__ import annotations

import sqlite3
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

