"""What runs inside the measuring worker process (mla_tune.measure.worker starts it): the message
loop that measures each batch it is sent, the backends guarded so that a sticky CUDA error ends the
process as a fault rather than as an ordinary invalid result, and the batch measurement that an
in-process runner shares. The messages it exchanges with the sweep are described in
mla_tune.measure.worker."""

from __future__ import annotations

import cProfile
import ctypes
import faulthandler
import os
import signal
import sys
from dataclasses import replace
from typing import Callable, Sequence

from mla_tune.families import get_family, register_family
from mla_tune.families.base import Candidate

# torch (measure.trial, measure.timing) is imported in the functions that measure: the sweep's
# command line imports this module, the worker process is the one that measures.

# CUDA errors that are sticky: after one, every CUDA call in the process fails
STICKY_CUDA_ERRORS = (
    "illegal memory access", "unspecified launch failure", "device-side assert",
    "misaligned address", "illegal instruction", "hardware stack error", "uncorrectable ecc",
    "cudaerrorillegaladdress", "cudaerrorlaunchfailure", "context is destroyed",
)


def is_sticky_cuda_error(text: str) -> bool:
    """Whether an error message says the CUDA context is poisoned (the process must be replaced)."""
    t = (text or "").lower()
    return any(p in t for p in STICKY_CUDA_ERRORS)


# ---------------------------------------------------------------- measuring one batch in-process

def measure_batch(workload, entries: Sequence[tuple[object, Candidate]], settings,
                  on_prepared: Callable[[Candidate, bool], None] | None = None) -> list:
    """Measure (backend, candidate) pairs of one workload here; one TrialResult per entry.

    Several candidates are measured interleaved (`trial.measure_interleaved`: round-robin, so
    drift spreads over all of them). `on_prepared(candidate, ok)` follows each preparation.
    """
    from mla_tune.measure.trial import measure_interleaved     # lazy: see the imports
    return measure_interleaved(list(entries), workload, settings, on_prepared=on_prepared)


def plain_result(result):
    """A TrialResult with plain-dict samples (what crosses the pipe and goes to the store)."""
    return replace(result, samples={k: [float(x) for x in v] for k, v in (result.samples or {}).items()})


class _ContextPoisoned(BaseException):
    """Raised inside the worker after a sticky CUDA error; a BaseException, so that the measuring
    code's `except Exception` does not record it as an ordinary runtime failure and go on."""

    def __init__(self, candidate: Candidate, message: str):
        super().__init__(message)
        self.candidate = candidate
        self.message = message


def _context_alive(device: str) -> bool:
    """Whether CUDA still works in this process (True off CUDA, and while a graph is being
    captured, when synchronising is not allowed and a failure is the capture's, not the GPU's)."""
    if not str(device).startswith("cuda"):
        return True
    try:
        import torch        # lazy: see the imports
        if torch.cuda.is_current_stream_capturing():
            return True
        torch.cuda.synchronize()
        torch.zeros(1, device=device).add_(1).item()
        return True
    except Exception:
        return False


class _Guarded:
    """Wraps a backend so that a sticky CUDA error in prepare/run/plan escapes as _ContextPoisoned."""

    def __init__(self, backend, device: str):
        self._b = backend
        self._device = device
        self.family = backend.family

    def __getattr__(self, name):
        return getattr(self._b, name)

    def _check(self, cand: Candidate, e: BaseException):
        text = f"{type(e).__name__}: {e}"
        if is_sticky_cuda_error(text) or not _context_alive(self._device):
            raise _ContextPoisoned(cand, f"CUDA context poisoned: {text}") from None

    def prepare(self, workload, cand, problem):
        try:
            p = self._b.prepare(workload, cand, problem)
        except Exception as e:
            self._check(cand, e)
            raise
        for attr in ("run", "plan"):
            fn = getattr(p, attr)
            if fn is not None:
                setattr(p, attr, self._wrap(fn, cand))
        return p

    def _wrap(self, fn, cand):
        def call(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as e:
                self._check(cand, e)
                raise
        return call


PROFILE_ENV = "MLA_TUNE_PROFILE"     # a folder: each worker writes its cProfile stats there


def _profiler():
    """A cProfile.Profile when MLA_TUNE_PROFILE names a folder (where the worker's time goes,
    cumulative over its batches, rewritten after each one), else None."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    return cProfile.Profile()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent goes (kill -9 of the sweep included)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:
        pass


def _preload(names: Sequence[str], device: str) -> None:
    """Import the kernels of families `names` now (their `available` check imports them), while
    the sweep is still planning, rather than inside the first candidate's preparation. Best
    effort: a family that cannot load says so when its first candidate is prepared."""
    for name in names:
        try:
            get_family(name).available(device)
        except Exception:  # noqa: BLE001 - see the docstring
            pass


def worker_main(conn, families: dict, settings, log_path: str | None, parent_pid: int,
                preload: Sequence[str] = ()) -> None:
    """The worker process: answer "measure" messages on `conn` until told to stop (None), the
    pipe closes, or a fault (reported first) ends it."""
    settings = _set_up(families, settings, log_path, parent_pid)
    backends: dict = {}
    profile = _profiler()
    conn.send(("ready", os.getpid()))
    _preload(preload, settings.device)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, workload, pairs = msg
        if not _measure_message(conn, workload, pairs, backends, settings, profile):
            return


def _set_up(families: dict, settings, log_path: str | None, parent_pid: int):
    """The process made a worker: it dies with its parent, leaves Ctrl-C to the sweep, writes
    its output to `log_path`, knows the parent's families; the settings it measures with."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the sweep's to handle; it stops us
    if os.getppid() == 1 and parent_pid != 1:
        os._exit(0)
    if log_path:
        # kernels and compilers write to fd 1/2; keep that out of the sweep's display, and keep a
        # fatal-signal traceback (faulthandler) for the trial's message
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=False)
    for name, target in families.items():
        register_family(name, target)
    if str(settings.device).startswith("cuda") and not settings.min_pool_bytes:
        from mla_tune.measure.timing import default_pool_bytes     # lazy: see the imports
        settings = replace(settings, min_pool_bytes=default_pool_bytes(settings.device))
    return settings


def _measure_message(conn, workload, pairs, backends: dict, settings, profile) -> bool:
    """Measure one batch and send its messages; False when the worker must exit (a fault, or a
    CUDA context poisoned)."""
    index = {c.key: i for i, (_, c) in enumerate(pairs)}
    entries = []
    for family, cand in pairs:
        if family not in backends:
            backends[family] = _Guarded(get_family(family, settings.profile), settings.device)
        entries.append((backends[family], cand))

    done = [0]

    def prepared(cand, ok):
        # an asynchronous fault surfaces at the next synchronisation, which may lie outside
        # the guarded calls (the correctness check's): ask CUDA before the next candidate runs
        if not ok and not _context_alive(settings.device):
            raise _ContextPoisoned(cand, "CUDA context poisoned while this candidate was "
                                         "prepared and checked (a sticky CUDA error)")
        done[0] += 1
        conn.send(("prepared", index[cand.key], bool(ok)))

    try:
        if profile is not None:
            profile.enable()
        try:
            results = measure_batch(workload, entries, settings, prepared)
        finally:
            if profile is not None:
                profile.disable()
                profile.dump_stats(os.path.join(os.environ[PROFILE_ENV], f"worker-{os.getpid()}.prof"))
    except _ContextPoisoned as p:
        # while preparing, each step synchronises, so the error belongs to that candidate;
        # while sampling, an asynchronous error may surface in a neighbour's launch
        culprit = index.get(p.candidate.key) if done[0] < len(entries) else None
        conn.send(("fault", culprit, "crash", p.message))
        return False
    sticky = [r for r in results if is_sticky_cuda_error(r.message)]
    if sticky:
        if len(results) == 1:
            conn.send(("result", [replace(plain_result(results[0]), invalid_reason="crash",
                                          message=f"CUDA context poisoned: {results[0].message}")]))
        else:   # the culprit cannot be told apart from its victims: re-measure one by one
            conn.send(("fault", None, "crash", f"CUDA context poisoned: {sticky[0].message}"))
        return False
    conn.send(("result", [plain_result(r) for r in results]))
    return True
