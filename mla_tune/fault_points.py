"""Named points of the tool's life where a test places a fault by event, not by wall clock.

A kill scheduled "2 s after start" lands before the DB exists on a slow machine and after the
sweep ended on a fast one. Each point below is passed when something observable has happened, so
a fault placed there hits its window on any machine:

    db-created        a new results DB is in place (whole: tables, schema version)
    journal-written   an append to the optuna journal is on disk (the first one: journal-written:1)
    trial-prepared    a candidate is prepared and about to be sampled: a trial in flight
    trial-stored      a trial and its samples are committed
    merge-copied      a merge source's rows are inserted, its transaction not yet committed
    emit-written      a tuned config's temporary file is written, not yet renamed into place

Set by the environment (tests and bench/integrity_pass.py; never in normal use):

    MLA_TUNE_FAULT_AT=EVENT[:N]   the fault strikes the N-th time (default 1) EVENT is passed
    MLA_TUNE_FAULT_DO=ACTION      kill (SIGKILL this process; default), stop (SIGSTOP: the test
                                  acts on a known state, then kills or continues it), readonly
                                  (from here on every write to the event's folder fails with
                                  EROFS, as on a file system remounted read-only: strace injects
                                  it into this process's system calls, SQLite's own included)
    MLA_TUNE_FAULT_LOG=PATH       every point passed is appended there ("EVENT N PID"), so a test
                                  asserts the event happened before its fault; with a log the
                                  fault strikes once, in the first process to get there (the
                                  workers of one `--gpus` sweep share the environment), whose
                                  pid it writes to PATH.fired

Unset, `at()` is one global test: no file, no system call.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

AT_ENV, DO_ENV, LOG_ENV = "MLA_TUNE_FAULT_AT", "MLA_TUNE_FAULT_DO", "MLA_TUNE_FAULT_LOG"
EVENTS = ("db-created", "journal-written", "trial-prepared", "trial-stored", "merge-copied",
          "emit-written")
ACTIONS = ("kill", "stop", "readonly")


def _plan() -> dict | None:
    at, log = os.environ.get(AT_ENV, ""), os.environ.get(LOG_ENV, "")
    if not at and not log:
        return None
    event, _, n = at.partition(":")
    action = os.environ.get(DO_ENV, "kill")
    if (at and event not in EVENTS) or action not in ACTIONS or (n and not n.isdigit()):
        raise SystemExit(f"{AT_ENV}={at!r} / {DO_ENV}={action!r}: events {', '.join(EVENTS)}; "
                         f"actions {', '.join(ACTIONS)}")
    return {"event": event, "n": int(n or 1), "action": action, "log": log, "seen": {}}


_PLAN = _plan()
if _PLAN is not None:     # the config writer is the plugin's (vllm-free core): it cannot import this
    from vllm_metax.core.tuned_config import files as _config_files
    _config_files.BEFORE_REPLACE = lambda tmp: at("emit-written", tmp)


def at(event: str, path: str | os.PathLike | None = None) -> None:
    """Fault point `event` passed (`path`: the file it concerns, for readonly)."""
    if _PLAN is not None:
        _passed(event, path)


def _passed(event: str, path) -> None:
    plan = _PLAN
    n = plan["seen"][event] = plan["seen"].get(event, 0) + 1
    if plan["log"]:
        fd = os.open(plan["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{event} {n} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
    if event != plan["event"] or n != plan["n"]:
        return
    if plan["log"]:
        try:             # once across processes: the first to get here claims the fault
            fd = os.open(plan["log"] + ".fired", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()}\n".encode())       # whose fault it was
        os.close(fd)
    if plan["action"] == "readonly":
        _read_only(path)
        return
    os.kill(os.getpid(), signal.SIGKILL if plan["action"] == "kill" else signal.SIGSTOP)


# the system calls that change a file; a read-only file system answers each with EROFS
_TRACER = None        # the strace of a readonly fault (it ends with this process)
_WRITES = ("write", "pwrite64", "writev", "pwritev", "pwritev2", "ftruncate", "fallocate",
           "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat", "symlink",
           "symlinkat", "mkdir", "mkdirat", "rmdir")


def _read_only(path) -> None:
    """Every write to the files of `path`'s folder (and their SQLite and lock side files) fails
    with EROFS from now on, for the rest of this process: strace attached to it injects the
    error into the kernel's answer, so SQLite's C writes see it exactly as on a read-only mount
    (a remount is refused while the sweep holds its files open for writing: EBUSY)."""
    if path is None or shutil.which("strace") is None:
        raise SystemExit(f"{DO_ENV}=readonly needs strace and a path at the event")
    folder = Path(path).resolve().parent
    names = {p.name for p in folder.iterdir()}
    names |= {f"{n}{s}" for n in list(names) for s in ("-wal", "-shm", "-journal", ".lock")}
    args = ["strace", "-qq", "-f", "-o", os.devnull, "-p", str(os.getpid()),
            # "?": a call this architecture lacks (rename on arm64) is no error
            "-e", "trace=" + ",".join("?" + c for c in _WRITES), "-e", "inject=all:error=EROFS"]
    for n in sorted(names):
        args += ["-P", str(folder / n)]
    global _TRACER
    _TRACER = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:       # attached once the kernel names a tracer
        with open(f"/proc/{os.getpid()}/status") as f:
            if any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f):
                return
        time.sleep(0.005)
    raise SystemExit(f"{DO_ENV}=readonly: strace did not attach (ptrace not permitted here?)")


__all__ = ["ACTIONS", "EVENTS", "at"]
