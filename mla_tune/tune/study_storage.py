"""Where a sweep's optuna studies are stored: a journal file (the workers of one host; readable by
`optuna-dashboard <path>`) or an RDB URL (PostgreSQL for several hosts: heartbeat and retry of a
dead worker's trials).

    open_storage(spec, heartbeat_s)  -> optuna storage (JournalStorage or RDBStorage)
    journal_storage(path)            -> JournalStorage on a file, unsynced appends, damage set aside
    check_rdb_url(url), is_rdb_url(spec), redact(url)
"""

from __future__ import annotations

import inspect
import json
import os
import sqlite3
import warnings
from pathlib import Path

from mla_tune import fault_points
from mla_tune.store.integrity import META_TABLE
from mla_tune.store.sqlite_file import connect_readonly
from mla_tune.validate import InputError, is_sqlite, output_file

# optuna and sqlalchemy (seconds to import) are imported in the functions that use them: the
# sweep's planning and checks (--dry-run, a bad --storage) import this module without a study

HEARTBEAT_S = 10          # default heartbeat interval of a claimed trial (RDB storages)
MAX_RETRY = 3             # a trial whose worker died is enqueued again at most this often


class StorageError(Exception):
    """The shared storage cannot be opened or used; the message says why."""


def quiet_optuna():
    """optuna, imported with its info logging and experimental warnings off."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def is_rdb_url(spec: str | Path) -> bool:
    """Whether a --storage names an RDB (a URL) rather than a journal file."""
    return "://" in str(spec)


def storage_file(spec: str | Path) -> Path | None:
    """The file a --storage writes: a journal file, or the DB file of a sqlite:/// URL; None for
    a database server (or a URL that does not parse: check_rdb_url says why)."""
    if not is_rdb_url(spec):
        return Path(spec)
    try:
        from sqlalchemy.engine import make_url
        u = make_url(str(spec))
    except Exception:  # noqa: BLE001 - ImportError, SQLAlchemy's ArgumentError and friends
        return None
    if not u.drivername.startswith("sqlite") or u.database in (None, "", ":memory:"):
        return None
    return Path(u.database)


def retry_callback():
    """optuna's callback that enqueues a stale trial again (at most MAX_RETRY times)."""
    optuna = quiet_optuna()
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) \
        or optuna.storages.RetryFailedTrialCallback            # optuna < 4.9
    return cls(max_retry=MAX_RETRY)


def open_storage(spec: str | Path, heartbeat_s: int | None = None):
    """An optuna storage from `spec`: an SQLAlchemy URL (postgresql://user@host/db, the way to
    share a sweep between hosts; sqlite:///file.db) opens an RDBStorage with a heartbeat on
    claimed trials; anything else is a JournalStorage file (workers of one host)."""
    optuna = quiet_optuna()
    spec = str(spec)
    if not is_rdb_url(spec):
        try:
            return journal_storage(spec)
        except OSError as e:
            raise StorageError(f"cannot open the optuna journal {spec}: {e}") from None
    hb = int(heartbeat_s or HEARTBEAT_S)
    if hb < 1:
        raise StorageError(f"--heartbeat must be at least 1 s, got {heartbeat_s}")
    kw = {"heartbeat_interval": hb, "grace_period": 2 * hb}
    cb = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in \
        inspect.signature(optuna.storages.RDBStorage).parameters else "failed_trial_callback"
    kw[cb] = retry_callback()
    try:
        return optuna.storages.RDBStorage(spec, engine_kwargs={"pool_pre_ping": True}, **kw)
    except ModuleNotFoundError as e:
        raise StorageError(f"the storage {redact(spec)} needs the Python module {e.name!r} "
                           "(pip install 'mla-tune[postgres]' for PostgreSQL)") from None
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors are many; the user needs one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"cannot open the optuna storage {redact(spec)}: {first}") from None


OPTUNA_RDB_TABLES = {"studies", "trials", "version_info"}


def check_rdb_url(url: str) -> None:
    """An RDB storage URL that parses; a SQLite one names a new or empty file or optuna's own
    DB, never a results DB or any other file (optuna would add its tables to it). InputError."""
    try:
        from sqlalchemy.engine import make_url
        u = make_url(url)
    except ImportError:
        return                      # open_storage says what is missing
    except Exception:  # noqa: BLE001 - SQLAlchemy's ArgumentError and friends
        raise InputError(f"--storage {redact(url)!r} is not a database URL "
                         "(e.g. postgresql://user@host/db)") from None
    if not u.drivername.startswith("sqlite") or u.database in (None, "", ":memory:"):
        return
    path = Path(u.database)
    output_file(path, "--storage")
    if path.exists() and path.stat().st_size:
        tables = set()
        if is_sqlite(path):
            try:
                conn = connect_readonly(path)
                try:
                    tables = {r[0] for r in conn.execute(
                        "select name from sqlite_master where type = 'table'")}
                finally:
                    conn.close()
            except (sqlite3.Error, OSError):
                tables = set()
        if not OPTUNA_RDB_TABLES <= tables:
            what = "an mla-tune results DB" if META_TABLE in tables else "not an optuna storage DB"
            raise InputError(f"--storage {url}: {path} is {what}; left untouched (name a new file "
                             "or optuna's own DB)")


def redact(url: str) -> str:
    """A URL without its password, for messages."""
    try:
        from sqlalchemy.engine import make_url
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url.split("@")[-1]


def heartbeat_on(storage) -> bool:
    """Whether the storage keeps heartbeats of running trials (an RDB storage with one set)."""
    from optuna.storages._heartbeat import is_heartbeat_enabled
    return is_heartbeat_enabled(storage)



def journal_storage(path):
    """Optuna's JournalStorage on a file: readable by `optuna-dashboard <path>`, safe to share
    between processes (optuna's SQLite storage locks under parallel use). Appends are not
    fsync'ed (optuna's file backend syncs every one: ~9 per grid trial, milliseconds each):
    what a process wrote survives its kill -9 in the page cache, so resume and dead-worker
    recovery read it; only an OS crash or a full disk can cut the tail, a torn last line that
    optuna's reader skips and the next append cuts away (`_cut_torn_tail`), and every
    measurement is in results.db, which SQLite syncs itself.

    The journal is a cache of what the results DB holds: one optuna cannot read (a line garbled
    or cut in the middle) is set aside as `<path>.damaged` and a new one started, whose studies
    the sweep seeds again and answers from the DB (nothing measured is lost or measured twice)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    backend = _unsynced(JournalFileBackend)
    try:
        return JournalStorage(backend(str(path)))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever optuna's replay of a damaged log raises
        aside = set_aside_damaged_journal(path, e)
    storage = JournalStorage(backend(str(path)))
    storage.rebuilt = aside           # where the damaged journal went (the sweep says so)
    return storage


def set_aside_damaged_journal(path, error: Exception):
    """Rename an unreadable journal to `<path>.damaged[.N]` under its lock (workers opening it at
    once set it aside once), unless another process has done so already; the new name or None."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
    from optuna.storages.journal._file import get_lock_file
    p = Path(path)
    with get_lock_file(JournalFileSymlinkLock(str(p))):      # the lock optuna's appends take
        try:
            JournalStorage(JournalFileBackend(str(p)))
            return None                                 # another worker set it aside first
        except OSError:
            raise
        except Exception:  # noqa: BLE001 - still damaged
            pass
        aside, n = p.with_name(p.name + ".damaged"), 0
        while aside.exists():
            n += 1
            aside = p.with_name(f"{p.name}.damaged.{n}")
        os.rename(p, aside)
    return aside


def _cut_torn_tail(path) -> None:
    """Cut a journal's last line if it lacks its newline (an append cut short by an OS crash or
    a full disk): optuna's reader skips it, but an append after it would glue the next record
    to it, and every later read would fail there. Called under the journal's lock."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        if not end:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos, cut = end, 0
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            i = f.read(step).rfind(b"\n")
            if i >= 0:
                cut = pos + i + 1
                break
        f.truncate(cut)


def _unsynced(backend_cls):
    """JournalFileBackend whose append_logs is optuna's, less the fsync (same lock, same format)."""
    try:
        from optuna.storages.journal._file import get_lock_file
    except ImportError:
        return backend_cls

    class UnsyncedJournalFileBackend(backend_cls):
        def append_logs(self, logs):
            if not hasattr(self, "_lock") or not hasattr(self, "_file_path"):
                return super().append_logs(logs)
            with get_lock_file(self._lock):
                _cut_torn_tail(self._file_path)
                text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
                with open(self._file_path, "ab") as f:
                    f.write(text.encode("utf-8"))
                    f.flush()
            fault_points.at("journal-written", self._file_path)

    return UnsyncedJournalFileBackend


