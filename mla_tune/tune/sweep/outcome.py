"""What a sweep did and how it reports it: the events a SweepObserver receives while it runs, and
the outcome per bucket (BucketOutcome) and per sweep (SweepOutcome, with where its time went)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.families.base import Candidate
from mla_tune.tune.search import Evaluation, SearchOutcome
from mla_tune.tune.sweep.buckets import Bucket
from mla_tune.tune.sweep.plan import PlannedBucket, SweepPlan


class SweepObserver:
    """Receives the sweep's events; subclass and override what you show. All no-ops here."""

    def on_start(self, plan: SweepPlan) -> None: ...

    def on_bucket(self, planned: PlannedBucket) -> None: ...

    def on_measuring(self, planned: PlannedBucket, candidates: list[Candidate]) -> None: ...

    def on_prepared(self, planned: PlannedBucket, candidate: Candidate, ok: bool) -> None: ...

    def on_trial(self, planned: PlannedBucket, evaluation: Evaluation,
                 best: Evaluation | None) -> None: ...

    def on_bucket_done(self, outcome: BucketOutcome) -> None: ...

    def on_done(self, outcome: SweepOutcome) -> None: ...


@dataclass
class BucketOutcome:
    """One bucket's search, and how long it took."""

    planned: PlannedBucket
    search: SearchOutcome
    seconds: float = 0.0

    @property
    def bucket(self) -> Bucket:
        return self.planned.bucket

    @property
    def invalid(self) -> int:
        return sum(not e.ok for e in self.search.evaluations)


@dataclass
class SweepOutcome:
    """What a sweep (or replay) did: per bucket the search, then the choice over the trials."""

    plan: SweepPlan
    buckets: list = field(default_factory=list)          # BucketOutcome
    rows: list = field(default_factory=list)             # trial rows the choice was made from
    choice: object = None                                 # choose.Choice, or None
    run_id: int | None = None
    measured: int = 0
    cached: int = 0
    faults: int = 0
    restarts: int = 0
    seconds: float = 0.0
    emitted: Path | None = None
    emit_note: str = ""
    stopped_early: int = 0                                # buckets cut by a budget
    workers: list = field(default_factory=list)           # distributed.WorkerReport, with --gpus
    time_split: dict = field(default_factory=dict)        # TIME_PARTS -> seconds (live sweeps)

    @property
    def valid_trials(self) -> int:
        return sum(e.ok for b in self.buckets for e in b.search.evaluations)

    def time_line(self) -> str:
        """Where the sweep's wall time went, in one line: the timed samples (GPU busy in the
        samples kept), first-use JIT, the rest of measuring in the worker (preparing, checking,
        capturing, warm-up, transfers), waiting for the worker to start and the run record, and
        this process's own work: planning (input checks, the families' imports, every bucket's
        space and study, up to the first bucket), the search and store between batches, and the
        choice and emitted config at the end."""
        t = self.time_split
        if not t:
            return ""
        wall = self.seconds or sum(v for v in t.values() if isinstance(v, (int, float)))
        own = max(0.0, wall - t.get("measure_s", 0.0) - t.get("startup_s", 0.0)
                  - t.get("plan_s", 0.0) - t.get("choose_s", 0.0))
        other = max(0.0, t.get("measure_s", 0.0) - t.get("samples_s", 0.0) - t.get("jit_s", 0.0))
        parts = [("timed samples", t.get("samples_s", 0.0)), ("JIT", t.get("jit_s", 0.0)),
                 ("other measuring", other), ("start-up", t.get("startup_s", 0.0)),
                 ("planning", t.get("plan_s", 0.0)), ("search/store", own),
                 ("choice/emit", t.get("choose_s", 0.0))]
        line = (f"time: {wall:.1f} s = " + " + ".join(f"{name} {v:.1f} s" for name, v in parts)
                + f" ({100 * t.get('samples_s', 0.0) / wall if wall else 0:.0f}% of the wall in timed samples)")
        if any(k in t for k in PHASE_NAMES):
            # the measuring worker's own split, JIT taken out of preparing and the timed samples
            # out of sampling, so the parts add up to "other measuring" (plus what crossed the pipe)
            net = dict(t)
            net["prepare_s"] = max(0.0, t.get("prepare_s", 0.0) - t.get("jit_s", 0.0))
            net["sample_s"] = max(0.0, t.get("sample_s", 0.0) - t.get("samples_s", 0.0))
            line += "\nother measuring: " + ", ".join(
                f"{name} {net.get(k, 0.0):.1f} s" for k, name in PHASE_NAMES.items())
        pl = t.get("planning")
        if pl:
            rest = max(0.0, t.get("plan_s", 0.0) - sum(pl.values()))
            line += "\nplanning: " + ", ".join(
                f"{name} {v:.1f} s" for name, v in
                [(n, pl.get(k, 0.0)) for k, n in PLANNING_NAMES.items()] + [("the rest", rest)])
        return line


PLANNING_NAMES = {"checks_s": "input checks", "early_s": "worker/probe/JIT start",
                  "families_s": "families (their imports)", "spaces_s": "search spaces",
                  "store_s": "workloads, studies and prebuild start"}

PHASE_NAMES = {"prepare_s": "preparing", "check_s": "correctness checks",
               "timer_s": "warm-up runs, plan timing and graph capture", "warm_s": "clock warm-up",
               "sample_s": "sampling rounds beyond the timed samples"}   # measure.trial.PHASES

