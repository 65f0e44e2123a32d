"""Faults of the machine a command runs on, told in one line: a full disk, a folder or file
turned read-only, an I/O error, an output that cannot be written. What happened, where, and
what a rerun does (a sweep resumes: every finished trial is committed). And whether a process
that left something behind (a temporary file, a claimed trial) was killed."""

from __future__ import annotations

import errno
import os
import sqlite3
import sys

_ERRNO = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "an I/O error",
    errno.EBADF: "the output is closed",
}
# what SQLite says for the same faults (sqlite3.OperationalError carries no errno)
_SQLITE = {
    "database or disk is full": "the disk is full",
    "attempt to write a readonly database": "the DB cannot be written (its file or folder is read-only)",
    "disk I/O error": "an I/O error",
    "unable to open database file": "the DB file cannot be opened (gone, or its folder not writable)",
    "readonly database": "the DB cannot be written (its file or folder is read-only)",
}


def is_fault(e: BaseException) -> bool:
    """An OSError, or an SQLite error that is the machine's fault rather than the DB's content."""
    if isinstance(e, OSError):
        return True
    if isinstance(e, sqlite3.OperationalError):
        text = str(e).lower()
        return any(k in text for k in _SQLITE)
    return False


def describe(e: BaseException) -> str:
    """What happened, in words, with the file it happened to when known."""
    if isinstance(e, OSError):
        what = _ERRNO.get(e.errno) or e.strerror or str(e) or type(e).__name__
        return f"{what} ({e.filename})" if e.filename else what
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = next((v for k, v in _SQLITE.items() if k in text.lower()), None)
    return f"{what} (SQLite: {text})" if what else f"SQLite: {text}"


def sweep_stopped(e: BaseException, db) -> str:
    """The one line for a fault that stopped a sweep: the trials stored so far stay, a rerun resumes."""
    return (f"the sweep stopped: {describe(e)}; every trial finished so far is stored in {db}: "
            "fix that and rerun the same command to resume")


def stdout_closed() -> bool:
    """Whether standard output is closed (`>&-`): Python then sets sys.stdout to None, and every
    print would vanish while the command exits 0."""
    if sys.stdout is None:
        return True
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return False                 # not a file (a test's StringIO): open
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def flush_stdout() -> None:
    """Flush standard output now, so a write error (a full disk, /dev/full, a closed pipe) is
    raised here, where it is reported, and not at interpreter exit as a stray message."""
    if sys.stdout is not None:
        sys.stdout.flush()


def silence_stdout() -> None:
    """Point standard output at /dev/null after a write to it failed: the interpreter's own final
    flush then has nowhere to fail."""
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs: a killed child its parent has not reaped
    yet (a zombie) does not; one this user may not signal does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


__all__ = ["describe", "flush_stdout", "is_fault", "process_alive", "silence_stdout", "stdout_closed",
           "sweep_stopped"]
