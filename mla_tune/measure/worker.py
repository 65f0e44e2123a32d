"""Crash isolation: candidates are measured in a worker process that is replaced after a fault.

A kernel can take its process down (segfault, abort), poison the CUDA context (an illegal memory
access makes every later CUDA call in that process fail), or hang. None of these may end a sweep
or corrupt the verdict on other candidates, so the sweep hands batches of candidates to a worker
process and waits for its messages with a per-candidate timeout:

    parent -> worker   ("measure", workload, [(family, candidate), ...])
    worker -> parent   ("ready", pid) once, then per batch ("prepared", index, ok) after each
                       candidate's preparation and ("result", [TrialResult, ...]) at the end,
                       or ("fault", index | None, reason, message) before it exits.

A fault is attributed to the candidate being prepared when it struck (the one after the last
"prepared" message); a fault after every candidate was prepared (while sampling) has no known
culprit, so the batch is re-measured one candidate per worker. The faulty candidate becomes an
invalid TrialResult with reason "crash" or "timeout"; the others are measured again in a fresh
worker, never reported from a poisoned one.

Workers start through a fork server that has torch and the measuring code imported, so a
replacement costs milliseconds, not an interpreter start; each worker dies with its parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from enum import Enum
from typing import Callable, Sequence

from mla_tune.families import family_targets, get_family
from mla_tune.families.base import Candidate
from mla_tune.measure.worker_main import measure_batch, plain_result, worker_main

_LOG_TAIL = 1500      # characters of the worker's output kept for a fault's message


class InlineRunner:
    """Measures in this process: no isolation (tests, debugging, or families known to be safe)."""

    isolated = False

    def __init__(self, settings):
        self.settings = settings
        self._backends: dict = {}
        self.restarts = 0

    def _backend(self, family: str):
        if family not in self._backends:
            self._backends[family] = get_family(family, self.settings.profile)
        return self._backends[family]

    def measure(self, workload, candidates: Sequence[Candidate],
                on_progress: Callable[[Candidate, bool], None] | None = None) -> list:
        entries = [(self._backend(c.family), c) for c in candidates]
        return [plain_result(r) for r in measure_batch(workload, entries, self.settings, on_progress)]

    def close(self) -> None:
        from mla_tune.measure.trial import PROBLEMS    # lazy: torch, and this is the CLI's import path
        self._backends.clear()
        PROBLEMS.clear()           # the last workload's instances are not needed after the sweep


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the worker vanished"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"worker process killed by {name}"
    return f"worker process exited with status {code}"


class WorkerError(RuntimeError):
    """The worker process cannot be started at all (not a candidate's fault)."""


class _Fault:
    def __init__(self, reason: str, index: int | None, message: str):
        self.reason, self.index, self.message = reason, index, message


_CONTEXT = None


@contextmanager
def _main_module_hidden():
    """Start processes without making them re-run the caller's __main__ script: multiprocessing
    does that to find functions defined there (the worker needs none), and a script without an
    `if __name__ == "__main__"` guard would start a sweep inside each worker."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _context():
    """A fork server with torch and the measuring code imported (spawn where there is none)."""
    global _CONTEXT
    if _CONTEXT is None:
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "mla_tune.measure.trial", "mla_tune.measure.timing",
                                        "mla_tune.measure.worker", "mla_tune.measure.worker_main"])
        except ValueError:
            ctx = mp.get_context("spawn")
        _CONTEXT = ctx
    return _CONTEXT


class WorkerRunner:
    """Measures in a worker process, replaced after each crash, hang or poisoned CUDA context.

    `timeout_s` bounds each candidate's preparation (JIT included) and, per candidate, the
    sampling rounds of a batch; `faults` counts the candidates recorded as crash/timeout.
    """

    isolated = True

    def __init__(self, settings, timeout_s: float = 120.0, start_timeout_s: float = 300.0,
                 families: dict | None = None, preload: Sequence[str] = ()):
        """`preload`: families whose kernels each worker imports as soon as it is up."""
        self.settings = settings
        self.preload = tuple(preload)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.families = dict(families if families is not None else family_targets())
        self.restarts = 0
        self.faults = 0
        self._proc = None
        self._conn = None
        self._log = None
        self._started = 0
        self.startup_s = 0.0        # seconds spent starting workers (a sweep's budget excludes it)

    # ------------------------------------------------------------ process management
    def _start(self) -> None:
        t0 = time.monotonic()
        try:
            self._spawn()
        finally:
            self.startup_s += time.monotonic() - t0

    def _spawn(self) -> None:
        ctx = _context()
        fd, self._log = tempfile.mkstemp(prefix="mla-tune-worker-", suffix=".log")
        os.close(fd)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, name="mla-tune-worker", daemon=True,
                           args=(child, self.families, self.settings, self._log, os.getpid(),
                                 self.preload))
        with _main_module_hidden():
            proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if self._started:
            self.restarts += 1
        self._started += 1
        try:
            ok = parent.poll(self.start_timeout_s)
            msg = parent.recv() if ok else None
        except (EOFError, OSError):
            msg = None
        if not msg or msg[0] != "ready":
            tail = self._log_tail()
            self._stop(kill=True)
            raise WorkerError("the measuring worker process did not start"
                              + (f": {tail}" if tail else ""))

    def _log_tail(self) -> str:
        """The end of the worker's output: from its fatal-error report if there is one."""
        try:
            with open(self._log, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 64 * _LOG_TAIL))
                text = f.read().decode(errors="replace")
        except (OSError, TypeError):
            return ""
        i = text.rfind("Fatal Python error")
        return (text[i:i + _LOG_TAIL] if i >= 0 else text[-_LOG_TAIL:]).strip()

    def _stop(self, kill: bool) -> int | None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        code = None
        if proc is not None:
            if not kill and conn is not None:
                try:
                    conn.send(None)
                except (OSError, ValueError):
                    pass
                proc.join(5)
            if proc.is_alive():
                proc.kill()
            proc.join(10)
            code = proc.exitcode
        if conn is not None:
            conn.close()
        if self._log:
            try:
                os.unlink(self._log)
            except OSError:
                pass
            self._log = None
        return code

    def start(self) -> None:
        """Start the worker now rather than at the first batch (a sweep overlaps it with its own
        start-up); WorkerError if it cannot start."""
        if self._proc is None or not self._proc.is_alive():
            self._start()

    def close(self) -> None:
        self._stop(kill=False)

    # ------------------------------------------------------------ measuring
    def measure(self, workload, candidates: Sequence[Candidate],
                on_progress: Callable[[Candidate, bool], None] | None = None) -> list:
        """One TrialResult per candidate, in order; faults become invalid crash/timeout results."""
        from mla_tune.measure.trial import TrialResult     # lazy: as in close
        results: list = [None] * len(candidates)
        pending = list(range(len(candidates)))
        singles = False
        while pending:
            batch = pending[:1] if singles else pending
            got = self._attempt(workload, [candidates[i] for i in batch], on_progress)
            if isinstance(got, list):
                for i, r in zip(batch, got):
                    results[i] = r
                pending = [i for i in pending if results[i] is None]
                continue
            if got.index is None and len(batch) > 1:
                singles = True          # unknown culprit: one candidate per worker from here on
                continue
            culprit = batch[got.index if got.index is not None else 0]
            self.faults += 1
            results[culprit] = TrialResult(candidates[culprit], "invalid", invalid_reason=got.reason,
                                           message=got.message)
            if on_progress is not None:
                on_progress(candidates[culprit], False)
            pending = [i for i in pending if results[i] is None]
        return results

    def _attempt(self, workload, cands: list[Candidate], on_progress):
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self._stop(kill=True)
            self._start()
        conn = self._conn
        try:
            conn.send(("measure", workload, [(c.family, c) for c in cands]))
        except (OSError, ValueError):
            code = self._stop(kill=True)
            return _Fault("crash", 0, _describe_exit(code))
        prepared = 0
        n = len(cands)
        while True:
            limit = self.timeout_s if prepared < n else self.timeout_s * n
            try:
                ready = conn.poll(limit)
            except (OSError, ValueError):
                ready = True
            if not ready:
                where = cands[prepared].key if prepared < n else f"sampling {n} candidates"
                tail = self._log_tail()
                self._stop(kill=True)
                return _Fault("timeout", prepared if prepared < n else None,
                              f"no answer from the worker within {limit:.0f} s ({where}); killed"
                              + (f"\n{tail}" if tail else ""))
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                tail = self._log_tail()
                code = self._stop(kill=True)
                return _Fault("crash", prepared if prepared < n else None,
                              _describe_exit(code) + (f"\n{tail}" if tail else ""))
            kind = msg[0]
            if kind == "prepared":
                prepared = max(prepared, msg[1] + 1)
                if on_progress is not None:
                    on_progress(cands[msg[1]], msg[2])
            elif kind == "result":
                crashed = sum(r.invalid_reason == "crash" for r in msg[1])
                if crashed:
                    self.faults += crashed
                    self._stop(kill=True)     # the worker exits after a poisoned context
                return msg[1]
            elif kind == "fault":
                self._stop(kill=True)
                return _Fault(msg[2], msg[1], msg[3])


class Isolation(str, Enum):
    """Where candidates run: a worker process (survives crashes and hangs), this process, or
    auto (a worker unless every family is the torch reference)."""
    auto = "auto"
    process = "process"
    inline = "inline"


ISOLATION = tuple(i.value for i in Isolation)


def make_runner(settings, isolation: str = "auto", timeout_s: float = 120.0, families=()):
    """The runner for an isolation mode: 'process' (WorkerRunner), 'inline' (InlineRunner), or
    'auto': a worker process unless every family is the torch reference, which cannot crash."""
    if isolation not in ISOLATION:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATION)}, got {isolation!r}")
    if isolation == "auto":
        isolation = "inline" if families and set(families) <= {"reference"} else "process"
    if isolation == "process":
        return WorkerRunner(settings, timeout_s=timeout_s, preload=tuple(families or ()))
    return InlineRunner(settings)
