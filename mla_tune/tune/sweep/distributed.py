"""Scale-out on one host: one sweep worker process per GPU (CUDA_VISIBLE_DEVICES set to it) on
a shared optuna storage (study_storage), every candidate measured once (shared_bucket), then a
final pass in the launching process that measures what dead workers left, chooses and emits.

    parse_gpus('0,1' | 'all')            -> ['0', '1']
    run_workers(config, gpus, observer)  -> SweepOutcome, with a WorkerReport per GPU

Several hosts share an RDB storage: each runs `mla-tune sweep --storage postgresql://...`.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from mla_tune.families import family_targets, register_family
from mla_tune.tune.sweep.config import SweepError
from mla_tune.tune.sweep.in_process import run_in_process
from mla_tune.tune.sweep.shared import seed_studies
from mla_tune.validate import InputError, ascii_int

POLL_S = 0.5              # how often the launcher looks at its worker processes


def parse_gpus(text: str) -> list[str]:
    """'0,1,2' -> ['0', '1', '2'] (what each worker's CUDA_VISIBLE_DEVICES is set to); '4' alone
    is GPU 4, 'all' is every GPU torch sees."""
    t = (text or "").strip()
    if t == "all":
        import torch
        n = torch.cuda.device_count()
        if not n:
            raise InputError("--gpus all: torch sees no CUDA device here (name the worker slots, "
                             "e.g. --gpus 0,1, to run CPU-reference workers)")
        return [str(i) for i in range(n)]
    parts = [p.strip() for p in t.split(",")]
    if not t or any(ascii_int(p, 4) is None for p in parts):
        raise InputError(f"bad --gpus {text!r}: GPU indices separated by commas, e.g. 0,1,2,3, or all")
    if len(set(parts)) != len(parts):
        raise InputError(f"bad --gpus {text!r}: a GPU is named twice")
    return parts


@dataclass
class WorkerReport:
    gpu: str
    pid: int
    returncode: int | None
    measured: int = 0
    cached: int = 0
    faults: int = 0
    error: str = ""              # the last line a failed worker wrote


def run_workers(config, gpus: Sequence[str], observer=None, poll_s: float = POLL_S):
    """One worker process per GPU (CUDA_VISIBLE_DEVICES set to it) on the config's shared
    storage, then, in this process, a final pass: it measures what dead workers left, chooses
    and emits. Returns the final pass's SweepOutcome with the workers' counts added and
    `workers` (WorkerReport per GPU)."""
    t0 = time.monotonic()
    seed_studies(config)              # before any worker runs: no study is seeded by a worker that dies
    tmp = Path(tempfile.mkdtemp(prefix="mla-tune-workers-"))
    procs = []
    try:
        for i, gpu in enumerate(gpus):
            wcfg = replace(config, gpus=None, worker_index=i, worker_count=len(gpus), emit=False,
                           role="worker")
            payload = tmp / f"worker{i}.pkl"
            with open(payload, "wb") as f:
                pickle.dump({"config": wcfg, "families": family_targets(), "path": sys.path}, f)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            # each worker its share of the host's cores: torch's thread pools would fight otherwise
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(gpus))))
            log = open(tmp / f"worker{i}.log", "wb")
            p = subprocess.Popen([sys.executable, "-m", "mla_tune.tune.sweep.distributed", str(payload),
                                  str(tmp / f"worker{i}.json")], env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=False)
            log.close()
            procs.append((gpu, p))
        if observer is not None and hasattr(observer, "on_workers"):
            observer.on_workers([(g, p.pid) for g, p in procs])
        while any(p.poll() is None for _, p in procs):     # poll() reaps: a dead worker is no zombie
            time.sleep(poll_s)
        reports = []
        for i, (gpu, p) in enumerate(procs):
            r = WorkerReport(gpu, p.pid, p.returncode)
            try:
                r.__dict__.update(json.loads((tmp / f"worker{i}.json").read_text()))
            except (OSError, ValueError):
                pass
            if r.returncode and r.returncode > 0:      # failed by itself, not killed
                lines = (tmp / f"worker{i}.log").read_text(errors="replace").strip().splitlines()
                r.error = lines[-1][:300] if lines else ""
            reports.append(r)
        errors = [i for i, r in enumerate(reports) if r.returncode and r.returncode > 0]
        if errors and all(r.returncode for r in reports):
            # no worker finished and one failed by itself (not killed): that failure is the news
            r = reports[errors[0]]
            raise SweepError(f"every worker failed (worker on GPU {r.gpu} exited {r.returncode}: "
                             f"{r.error})")
        held = _HeldSummary(observer)
        outcome = run_in_process(replace(config, gpus=None, role="final"), held)
        outcome.workers = reports
        outcome.measured += sum(r.measured for r in reports)
        outcome.cached = max(0, outcome.cached - sum(r.measured for r in reports))
        outcome.faults += sum(r.faults for r in reports)
        outcome.seconds = time.monotonic() - t0
        if observer is not None:
            observer.on_done(outcome)        # with the workers' counts in it
        return outcome
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


class _HeldSummary:
    """Passes every event of the final pass on but the last, which waits for the workers' counts."""

    def __init__(self, observer):
        self._observer = observer

    def __getattr__(self, name):
        if name == "on_done" or self._observer is None:
            return lambda *a, **k: None
        return getattr(self._observer, name)


def _worker_main(payload: str, report: str) -> int:
    with open(payload, "rb") as f:
        job = pickle.load(f)
    sys.path[:0] = [p for p in job["path"] if p not in sys.path]   # the launcher's modules too
    for name, target in job["families"].items():
        register_family(name, target)
    out = run_in_process(job["config"])
    Path(report).write_text(json.dumps({"measured": out.measured, "cached": out.cached,
                                        "faults": out.faults}))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], sys.argv[2]))
