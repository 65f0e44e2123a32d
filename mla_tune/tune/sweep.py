"""The sweep: plan each bucket's search, measure its candidates, store every trial, resume.

    plan_buckets(...)            -> [Bucket]        model x TP sizes x batch x context x q_len (buckets.py)
    SweepConfig(...)                                what to measure and how (defaults per device)
    build_config(**flags)        -> SweepConfig     from command-line values (sweep_flags.py)
    run_sweep(config, observer)  -> SweepOutcome    measure (in a worker process), store, choose, emit
    replay_sweep(db, config)     -> SweepOutcome    the same search over stored measurements (replay.py)

The names of buckets.py, sweep_flags.py and replay.py are importable from here as well.

Every trial is committed through ResultsStore.add_trial as soon as its batch returns, with the run
record of environment.capture_environment. Rerunning the same sweep is a resume: a (workload,
candidate) already measured on this device is answered from the store (not measured again unless
`remeasure`), so the search retraces its steps for free and measures only what is missing.

Without CUDA the sweep measures the torch reference on the CPU (CPU_REFERENCE_NOTE says why);
its numbers test the pipeline, not a kernel. The library prints nothing: progress goes to a
SweepObserver (the CLI's draws a rich progress bar).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from mla_tune.families.base import Candidate, CandidateInvalid
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.defaults import KERNEL_METRIC, SWEEP_PAGE_SIZES
from mla_tune.problem.workload import ProblemError, Workload, WorkloadMix
from mla_tune.tune.buckets import (CPU_DB, DEFAULT_RAGGED, GPU_DB, Bucket, DefaultSpace,  # noqa: F401
                                   default_db, default_space, detect_device, journal_path_for,
                                   measure_settings, parse_duration, parse_sizes, plan_buckets,
                                   resolve_lengths)
from mla_tune.tune.search import (GRID_MAX, PATIENCE, Evaluation, SearchOutcome, SearchPolicy,
                             SearchSpace, search)
from mla_tune.tune.choose import MIN_RATIO, P_THRESHOLD

CPU_REFERENCE_NOTE = (
    "No CUDA device here (torch.cuda.is_available() is False), so this sweep measures the CPU "
    "torch reference: the correctness oracle run with torch on the CPU, not a serving kernel. Its "
    "numbers exercise the pipeline (store, search, winners, config); they say nothing about "
    "FlashInfer or Triton speed. Run on a GPU for real measurements.")
# flashmla: opt-in (--family flashmla) until the plugin serves FLASHMLA; split is served by
# FLASHINFER_MLA's decode in the buckets it wins
GPU_FAMILIES = ("flashinfer", "triton", "split")
CPU_FAMILIES = ("reference",)


class SweepError(Exception):
    """A sweep that cannot start or cannot produce anything (the message says why)."""


class SweepInputError(SweepError, ValueError):
    """A sweep asked for something that does not exist (an unknown family, an empty replay DB)."""


# ---------------------------------------------------------------- configuration and events

@dataclass
class SweepConfig:
    """What to sweep and how. `families=None` picks by device (GPU: flashinfer + triton; CPU: the
    reference); `time_budget_s=0` and `max_trials=None` mean no limit; `journal=None` puts the
    optuna study next to the DB (False: keep it in memory); `db=None` is default_db(device) and
    `emit=None` emits on a GPU only (the CPU reference is not a serving device)."""

    buckets: list
    db: Path | None = None               # None: default_db(device)
    families: Sequence[str] | None = None
    page_sizes: Sequence[int] = SWEEP_PAGE_SIZES
    device: str | None = None
    settings: MeasureSettings | None = None
    mode: str = "auto"
    grid_max: int = GRID_MAX
    max_trials: int | None = None
    patience: int | None = PATIENCE
    time_budget_s: float = 0.0
    batch: int = 32                      # candidates per worker round trip (one interleaved set)
    seed: int = 0
    timeout_s: float = 120.0
    isolation: str = "auto"
    remeasure: bool = False
    name: str = "sweep"
    journal: Path | bool | None = None
    mix: WorkloadMix | None = None
    min_ratio: float = MIN_RATIO
    p_threshold: float = P_THRESHOLD
    emit: bool | None = None             # None: on a GPU yes, for the CPU reference no
    configs_dir: Path = Path("configs")
    command: str = ""
    storage: str | None = None          # shared optuna storage: RDB URL or journal file (None: journal)
    heartbeat_s: int | None = None      # RDB storages: heartbeat of a claimed trial
    gpus: Sequence[str] | None = None   # one worker process per GPU (mla_tune.tune.distributed)
    worker_index: int = 0
    worker_count: int = 1
    role: str = "single"                # single | worker (measures only) | final (after workers)
    study_tag: str = ""                 # set once per --remeasure launch: fresh studies for it

    def policy(self, deadline: float | None) -> SearchPolicy:
        return SearchPolicy(self.mode, self.grid_max, self.max_trials, deadline, self.patience,
                            self.batch, seed=self.seed)


class SweepObserver:
    """Receives the sweep's events; subclass and override what you show. All no-ops here."""

    def on_start(self, plan: "SweepPlan") -> None: ...

    def on_bucket(self, planned: "PlannedBucket") -> None: ...

    def on_measuring(self, planned: "PlannedBucket", candidates: list[Candidate]) -> None: ...

    def on_prepared(self, planned: "PlannedBucket", candidate: Candidate, ok: bool) -> None: ...

    def on_trial(self, planned: "PlannedBucket", evaluation: Evaluation,
                 best: Evaluation | None) -> None: ...

    def on_bucket_done(self, outcome: "BucketOutcome") -> None: ...

    def on_done(self, outcome: "SweepOutcome") -> None: ...


@dataclass
class PlannedBucket:
    """A bucket with its search space (constraints applied) and search plan."""

    bucket: Bucket
    space: SearchSpace
    mode: str
    budget: int
    workload_id: int | None = None
    index: int = 0


@dataclass
class SweepPlan:
    device: str
    kind: str                      # "gpu" | "cpu-reference"
    families: list                 # families that run here
    skipped: dict                  # family -> why it does not run here
    buckets: list                  # PlannedBucket
    note: str = ""
    db: Path | None = None
    journal: Path | None = None
    replay: bool = False
    storage: str = ""              # a shared RDB storage, password hidden ("" for a journal file)
    db_uid: str = ""               # with a journal file: the results DB its studies belong to

    @property
    def planned_trials(self) -> int:
        return sum(p.budget for p in self.buckets)


@dataclass
class BucketOutcome:
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


# ---------------------------------------------------------------- planning

def resolve_families(requested: Sequence[str] | None, device: str) -> tuple[dict, dict]:
    """(available family -> backend, skipped family -> reason). Unknown names raise
    SweepInputError; `None` picks by device (GPU_FAMILIES on a GPU, CPU_FAMILIES without)."""
    from mla_tune.families import family_names, get_family
    names = list(requested) if requested else list(
        GPU_FAMILIES if device.startswith("cuda") else CPU_FAMILIES)
    unknown = [n for n in names if n not in family_names()]
    if unknown:
        raise SweepInputError(f"unknown kernel family {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(family_names())}")
    available, skipped = {}, {}
    for n in dict.fromkeys(names):
        backend = get_family(n)
        try:
            a = backend.available(device)
        except Exception as e:  # a family that cannot even say is a family that cannot run
            a = None
            skipped[n] = f"{type(e).__name__}: {e}"
        if a is not None:
            if a.ok:
                available[n] = backend
            else:
                skipped[n] = a.reason
    return available, skipped


def _unsupported_key(c: Candidate, w: Workload) -> tuple:
    # a refusal ("unsupported") depends on the device, the kernel, the page size and the head
    # geometry, not on batch or context: the same candidate is not tried again in later buckets
    return (c.family, c.backend, c.page_size, tuple(sorted(c.params.items())), w.num_heads,
            w.kv_lora_rank, w.qk_rope_head_dim, w.q_len, w.q_dtype, w.kv_dtype)


def _space_for(bucket: Bucket, backends: dict, page_sizes: Sequence[int], refused: dict) -> SearchSpace:
    w = bucket.workload
    cands, defaults = [], []
    for fam, backend in backends.items():
        try:
            cands += backend.space(w, list(page_sizes))
        except CandidateInvalid:
            continue
        for p in page_sizes:
            try:
                d = backend.default_candidate(w, p)
            except CandidateInvalid:
                continue
            if d.page_size in page_sizes:
                defaults.append(d)

    def refused_before(c: Candidate):
        if c in defaults:          # the baseline is always tried: every verdict needs it
            return None
        hit = refused.get(_unsupported_key(c, w))
        return f"refused in {hit[0]}: {hit[1]}" if hit else None

    return SearchSpace.build(cands, defaults, [refused_before])


def _value(row_or_result_samples: dict | None, ok: bool) -> float | None:
    xs = (row_or_result_samples or {}).get(KERNEL_METRIC) or []
    return float(statistics.median(xs)) if ok and xs else None


def _study_name(config: SweepConfig, b: Bucket, space: SearchSpace | None = None) -> str:
    """The bucket's optuna study. With `space` (the bucket's declared candidates, before any
    refusal learnt on this machine), the shared study's name: a fingerprint of that space, so a
    sweep over other page sizes or families is another study, and the --remeasure tag."""
    w = b.workload
    name = f"{config.name} | {b.label} | {w.q_dtype}/{w.kv_dtype} | seed {w.seed}"
    if space is None:
        return name
    import hashlib
    digest = hashlib.sha1("\n".join(sorted(c.key for c in space.candidates)).encode()).hexdigest()
    return f"{name} | space {digest[:10]}" + (f" | {config.study_tag}" if config.study_tag else "")


def plan_bucket(bucket: Bucket, space: SearchSpace, config: SweepConfig,
                workload_id: int | None = None, index: int = 0) -> PlannedBucket:
    """A bucket's search plan, decided once: its space, the mode the policy resolves for the
    space's size and the trial budget (0 for an empty space). The live sweep, its re-planning
    after a refusal and the replay all plan through here."""
    pol = config.policy(None)
    mode = pol.resolve_mode(len(space))
    return PlannedBucket(bucket, space, mode, pol.budget(len(space), mode) if len(space) else 0,
                         workload_id, index)


def plan_sweep(config: SweepConfig, store=None, families: tuple | None = None) -> tuple[SweepPlan, dict]:
    """Resolve the device and families (`families`: what resolve_families already answered)
    and build every bucket's search space (nothing runs)."""
    device = config.device or detect_device()
    backends, skipped = families or resolve_families(config.families, device)
    kind = "gpu" if device.startswith("cuda") else "cpu-reference"
    note = CPU_REFERENCE_NOTE if kind == "cpu-reference" and "reference" in backends else ""
    if device.startswith("cuda") and "reference" in backends:
        note = "Measuring the torch reference on the GPU: an oracle, not a serving kernel."
    refused = _refusals(store, device) if store is not None and not config.remeasure else {}
    planned = []
    for i, b in enumerate(config.buckets):
        planned.append(plan_bucket(b, _space_for(b, backends, config.page_sizes, refused), config,
                                   index=i))
    db = Path(config.db) if config.db is not None else default_db(device)
    journal, storage = None, ""
    if config.storage:
        from mla_tune.tune.distributed import _redact, is_rdb_url
        if is_rdb_url(config.storage):
            storage = _redact(config.storage)
        else:
            journal = Path(config.storage)
    elif config.journal is not False:
        journal = Path(config.journal) if config.journal else journal_path_for(db)
    plan = SweepPlan(device, kind, list(backends), skipped, planned, note, db, journal,
                     storage=storage, db_uid=store.db_uid if journal is not None and store is not None else "")
    return plan, {"backends": backends, "refused": refused}


def _open_storage(config: SweepConfig, plan: SweepPlan):
    """The optuna storage the plan's studies live in (None: in memory)."""
    from mla_tune.tune.distributed import open_storage
    if config.storage:
        return open_storage(config.storage, config.heartbeat_s)
    return open_storage(plan.journal) if plan.journal else None


def _shared_bucket(storage, config: SweepConfig, plan: SweepPlan, p: PlannedBucket, backends: dict,
                   device_name: str, heartbeat=None, store=None):
    """Bucket p's study in the shared storage, created and seeded if no other process has done
    so: with its grid (in measuring order, cut to its budget), or for TPE with the family
    defaults (TPE proposes the rest). With `store` (the results DB a journal belongs to), the
    study is checked against the DB: what it says was measured and the DB lacks is measured again."""
    from mla_tune.tune.distributed import SharedBucket
    from mla_tune.tune.search import tpe_sampler
    declared = _space_for(p.bucket, backends, config.page_sizes, {})
    name = f"{_study_name(config, p.bucket, declared)} | {p.mode} | {device_name}"
    if plan.db_uid:     # a journal serves the workers of one results DB, and only that DB
        name += f" | db {plan.db_uid[:12]}"
    pol = config.policy(None)
    if p.mode == "grid":
        seed, sampler = p.space.grid_order(by_page=p.budget >= len(p.space),
                                           first_page=pol.first_page)[:p.budget], None
    else:
        seed, sampler = p.space.defaults[:p.budget], tpe_sampler(pol.seed, len(p.space))
    grace = 2.0 * (config.heartbeat_s or 10) + 10.0
    sb = SharedBucket(storage, name, declared, heartbeat=heartbeat, grace_s=grace)
    sb.created = sb.open(seed, {"mode": p.mode, "space_size": len(p.space),
                                "device_name": device_name}, sampler=sampler)
    if store is not None and plan.db_uid:
        sb.recheck(store.trial_candidates)
    return sb


def seed_studies(config: SweepConfig) -> int:
    """Create and seed every bucket's shared study (what `--gpus` does before its workers
    start); the number of studies this call created."""
    from mla_tune.problem.roofline import workload_bytes, workload_flops
    from mla_tune.store.results import ResultsStore
    _tag_remeasure(config)
    with ResultsStore(config.db) as store:
        plan, ctx = plan_sweep(config, store)
        if not plan.families:
            why = "; ".join(f"{f}: {r}" for f, r in plan.skipped.items())
            raise SweepError(f"no kernel family can run on {plan.device} ({why})")
        for p in plan.buckets:
            w = p.bucket.workload
            p.workload_id = store.workload_id(w, workload_bytes(w), workload_flops(w))
    storage = _open_storage(config, plan)
    if storage is None:
        raise SweepInputError("several workers need a shared optuna storage (--storage or a journal)")
    device_name = _device_name(plan.device)
    return sum(_shared_bucket(storage, config, plan, p, ctx["backends"], device_name).created
               for p in plan.buckets if len(p.space))


def _tag_remeasure(config: SweepConfig) -> None:
    # --remeasure measures everything again: in studies of its own, shared by this launch's workers
    if config.remeasure and not config.study_tag:
        import uuid
        config.study_tag = f"remeasure {time.strftime('%Y%m%dT%H%M%S')} {uuid.uuid4().hex[:6]}"


def _device_name(device: str) -> str:
    from vllm_metax.core.device import detect_device as detect
    return detect().name if device.startswith("cuda") else "cpu"


def _refusals(store, device: str) -> dict:
    out = {}
    name = _device_name(device)
    for r in store.trials("r.device_name = ? and t.status = 'invalid' and t.invalid_reason = 'unsupported'",
                          [name]):
        try:
            w = Workload.from_row(r)
        except ProblemError:     # a row another version wrote: its refusal is not learnt
            continue
        c = Candidate(r["family"], r["backend"], r["page_size"], r["params"])
        out.setdefault(_unsupported_key(c, w), (w.label(), (r["message"] or "").splitlines()[0][:200]))
    return out


# ---------------------------------------------------------------- the live sweep

JIT_S = 0.5      # a preparation longer than this is first-use compilation, not the bucket's search


class CeilingsProbe:
    """Copy bandwidth and matmul rate of this GPU for the run record (roofline %), measured in a
    child process so this process never initialises CUDA before its workers fork. Started at
    once (`start`), so the child's interpreter and CUDA start overlap the worker's; `result`
    waits for it ({} on any failure), `close` ends it if never asked."""

    CODE = ("import json; from mla_tune.problem.roofline import measure_ceilings; "
            "c = measure_ceilings('cuda'); print(json.dumps({k: c[k] for k in ('copy_gbps', 'matmul_tflops')}))")

    def __init__(self, timeout: float = 180.0):
        self.timeout = timeout
        self.proc = None

    def start(self) -> "CeilingsProbe":
        import subprocess
        import sys
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def result(self) -> dict:
        import json
        import subprocess
        if self.proc is None:
            return {}
        try:
            out, _ = self.proc.communicate(timeout=self.timeout)
            return json.loads(out.strip().splitlines()[-1]) if self.proc.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            self.close()
            return {}
        finally:
            self.proc = None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def ceilings_in_subprocess(timeout: float = 180.0) -> dict:
    """CeilingsProbe, started and waited for: {} on failure."""
    return CeilingsProbe(timeout).start().result()


class _Measurer:
    """Answers a bucket's candidates from the store, or measures them and commits each trial."""

    def __init__(self, store, runner, plan: SweepPlan, config: SweepConfig, outcome: SweepOutcome,
                 obs: SweepObserver, refused: dict, device_name: str):
        self.store, self.runner, self.plan, self.config = store, runner, plan, config
        self.outcome, self.obs, self.refused, self.device_name = outcome, obs, refused, device_name
        self.run_id: int | None = None
        self.ceilings: CeilingsProbe | None = None     # started early by run_sweep on a GPU
        self.first_round = True     # the sweep's first round trip to the worker is still to come

    def _run(self) -> int:
        if self.run_id is None:     # a rerun that measures nothing adds no run record
            from mla_tune.measure.environment import capture_environment
            env = capture_environment(self.plan.kind, self.config.command)
            if self.config.role == "worker" or os.environ.get("CUDA_VISIBLE_DEVICES"):
                # workers of one host differ by GPU: their run records say which
                env["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
                env["worker"] = f"{self.config.worker_index + 1}/{self.config.worker_count} pid {os.getpid()}"
            if self.plan.kind == "gpu":
                env.update(self.ceilings.result() if self.ceilings is not None
                           else ceilings_in_subprocess())
            self.run_id = self.store.add_run(env)
            self.outcome.run_id = self.run_id
        return self.run_id

    def evaluator(self, p: PlannedBucket, policy: SearchPolicy):
        """The search's evaluate(candidates) for bucket p; JIT time extends policy.deadline."""
        cache = {} if self.config.remeasure else _cached(self.store, p.workload_id, self.device_name)
        best: list = [None]
        w = p.bucket.workload

        def evaluate(cands: list[Candidate], claims: list[str] | None = None) -> list[Evaluation]:
            evs: dict[str, Evaluation] = {}
            todo = []
            claim_of = dict(zip((c.key for c in cands), claims or ()))
            # a claim another worker on this DB stored already (its worker was failed as dead
            # after storing it): answered, not measured again
            stored = self.store.claimed(list(claim_of.values())) if claim_of else {}
            for c in cands:
                row = stored.get(claim_of.get(c.key)) or cache.get(c.key)
                if row is None:
                    todo.append(c)
                    continue
                ok = row["status"] == "ok"
                evs[c.key] = self._report(p, best, Evaluation(
                    c, _value(row["samples"], ok), True, row["invalid_reason"], row["id"]))
                self.outcome.cached += 1
            if not todo:
                return [evs[c.key] for c in cands]
            t_run = time.monotonic()
            run_id = self._run()            # once per sweep: run record, ceilings measured in a child
            split = self.outcome.time_split
            split["startup_s"] = split.get("startup_s", 0.0) + time.monotonic() - t_run
            if policy.deadline is not None:
                policy.deadline += time.monotonic() - t_run
            self.obs.on_measuring(p, todo)
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            started_s = getattr(self.runner, "startup_s", 0.0)
            t_measure = time.monotonic()
            results = self.runner.measure(w, todo, lambda c, ok: self.obs.on_prepared(p, c, ok))
            started_s = getattr(self.runner, "startup_s", 0.0) - started_s
            split["startup_s"] += started_s
            split["measure_s"] = split.get("measure_s", 0.0) + time.monotonic() - t_measure - started_s
            if policy.deadline is not None:     # starting (or replacing) the worker is not search
                policy.deadline += started_s
            # the sweep's first round trip carries the worker's one-time costs (first CUDA use,
            # first capture, clocks ramping up from idle, modules loaded): start-up, not the
            # bucket's search. H200 2026-12-04: 3.6 s beyond JIT for 18 candidates of the first
            # bucket (~1 s for 31-35 in the buckets after it), over a share of ~1.7 s (estimated from
            # the bucket weights) of a 300 s budget, so the first bucket lost its other page sizes
            # in a sweep that used 124 s.
            first_round, self.first_round = self.first_round, False
            jit_in_round = 0.0
            for c, r in zip(todo, results):
                tid = self.store.add_trial(
                    run_id, p.workload_id, c, r.status, r.samples or None,
                    invalid_reason=r.invalid_reason, message=r.message, compile_s=r.compile_s,
                    max_rel_error=r.max_rel_error, sweep=self.config.name, started_at=started,
                    is_default=c in p.space.defaults, claim=claim_of.get(c.key))
                ok = r.status == "ok"
                ev = Evaluation(c, _value(r.samples, ok), False, r.invalid_reason, tid)
                if ok and ev.value is None:
                    ev = replace(ev, reason="runtime")
                if r.invalid_reason == "unsupported":
                    first = (r.message or "").splitlines()[0][:200] if r.message else ""
                    self.refused.setdefault(_unsupported_key(c, w), (w.label(), first))
                if (r.compile_s or 0) > JIT_S:
                    split["jit_s"] = split.get("jit_s", 0.0) + r.compile_s
                    jit_in_round += r.compile_s
                    if policy.deadline is not None:
                        policy.deadline += r.compile_s
                split["samples_s"] = split.get("samples_s", 0.0) + sum(
                    (r.samples or {}).get(KERNEL_METRIC) or ()) / 1e6
                for k, v in (getattr(r, "phase_s", None) or {}).items():
                    split[k] = split.get(k, 0.0) + v
                evs[c.key] = self._report(p, best, ev)
                self.outcome.measured += 1
            if first_round and policy.deadline is not None:
                policy.deadline += max(0.0, time.monotonic() - t_measure - started_s - jit_in_round)
            return [evs[c.key] for c in cands]

        return evaluate

    def _report(self, p, best: list, ev: Evaluation) -> Evaluation:
        _note_best(best, ev)
        self.obs.on_trial(p, ev, best[0])
        return ev


# A trial's cost is a fixed part (prepare, correctness gate, plan timing) plus the timed launches,
# which scale with the bytes the kernel moves. H200 default sweep, 2026-12-02: ~45 ms per trial
# at B1 L1K, ~170 ms at B128 L32K (4.8 GB of KV) with 16 heads, more with 128 (Triton's 2.6 ms
# kernels): the two parts are about equal near 1 GB. Only ratios matter.
_TRIAL_FIXED_BYTES = 1e9


def bucket_weight(p: PlannedBucket) -> float:
    """Expected relative cost of searching bucket p: trials x (fixed + bytes-proportional part)."""
    from mla_tune.problem.roofline import workload_bytes
    trials = max(1, min(p.budget or len(p.space), len(p.space)))
    return trials * (1.0 + workload_bytes(p.bucket.workload) / _TRIAL_FIXED_BYTES)


def budget_share(seconds_left: float, weights: Sequence[float]) -> float:
    """The next bucket's seconds: its weight's fraction of the time left over the buckets left
    (weights[0] is the next bucket's). Buckets that finish early leave their rest to the others."""
    total = sum(weights)
    return seconds_left * (weights[0] / total if total > 0 else 1.0 / max(1, len(weights)))


def check_search_settings(config: SweepConfig) -> None:
    """The search and choice settings a live sweep and a replay share, each by its rule."""
    from mla_tune import validate as v
    v.check_int("seed", config.seed, "--seed")
    v.check_int("grid_max", config.grid_max, "--grid-max")
    if config.max_trials is not None:
        v.check_int("trials", config.max_trials, "--trials")
    if config.patience is not None:
        v.check_int("patience", config.patience, "--patience")
    v.check_float("min_ratio", config.min_ratio, "--min-ratio")


def check_sweep_config(config: SweepConfig, families: bool = True) -> SweepConfig:
    """Every value and path of a live sweep checked against its rule (mla_tune.validate), the
    device defaults filled in (DB, emit); raises before the sweep writes anything: no DB row, no
    journal, no config. Returns the config with `device`, `db` and `emit` resolved.
    `families=False` leaves out whether any kernel family can run here (check_families: it
    imports the kernels' packages, FlashInfer and vLLM, seconds of the sweep's start-up)."""
    from mla_tune import validate as v
    from mla_tune.store.results import is_results_db
    device = config.device or detect_device()
    db = Path(config.db) if config.db is not None else default_db(device)
    emit = config.emit if config.emit is not None else device.startswith("cuda")
    check_search_settings(config)
    v.check_name("--name", config.name)
    v.check_float("timeout", config.timeout_s, "--timeout")
    v.check_float("time_budget", config.time_budget_s, "--time-budget")
    if not config.page_sizes:
        raise v.InputError("no page size to sweep")
    for p in config.page_sizes:
        v.check_page_size(p, "--page-size")
    if config.settings is not None:
        v.check_int("samples", config.settings.samples, "--samples")
        v.check_int("warmup", config.settings.warmup, "--warmup")
    if len(config.buckets) > v.MAX_BUCKETS:
        raise v.InputError(f"{len(config.buckets)} buckets is more than one sweep takes "
                           f"({v.MAX_BUCKETS}); split it")
    if not config.buckets:
        raise v.InputError("no bucket to sweep")
    if config.families is not None:
        from mla_tune.families import family_names
        names = list(config.families)
        unknown = [n for n in names if n not in family_names()]
        if not names or unknown:
            raise SweepInputError(f"unknown kernel family {', '.join(map(repr, unknown or ['']))}; "
                                  f"known: {', '.join(family_names())}")
    if config.mix is not None:
        config.mix.check_covers({(b.workload.batch_size, b.workload.context_len)
                                 for b in config.buckets}, "the sweep's buckets")
    v.output_file(db, "--db", own=is_results_db)
    check_storage(config)
    if config.journal is not False and config.storage is None:
        journal = Path(config.journal) if config.journal else journal_path_for(db)
        v.output_file(journal, "--journal", own=v.is_optuna_journal)
    if emit:
        v.output_folder(config.configs_dir, "--configs-dir")
    config = replace(config, device=device, db=db, emit=emit)
    if families:
        check_families(config)
    return config


def check_storage(config: SweepConfig) -> None:
    """--storage and --heartbeat by the rules --journal has: a journal file must be an optuna
    journal (or new, or empty) in a folder that can take it; an RDB URL must parse, and a
    SQLite one must name optuna's own DB (never a results DB or another file); a heartbeat is
    bounded and applies to an RDB storage only."""
    from mla_tune import validate as v
    from mla_tune.tune.distributed import check_rdb_url, is_rdb_url
    storage = config.storage
    if storage is not None:
        if not str(storage).strip():
            raise v.InputError("--storage: empty; name a journal file or an RDB URL "
                               "(postgresql://user@host/db)")
        if is_rdb_url(storage):
            check_rdb_url(str(storage))
        else:
            v.output_file(storage, "--storage", own=v.is_optuna_journal)
    if config.heartbeat_s is not None:
        v.check_int("heartbeat", config.heartbeat_s, "--heartbeat")
        if storage is None or not is_rdb_url(storage):
            raise v.InputError("--heartbeat applies to an RDB --storage only (postgresql://...); "
                               "a journal file's workers are watched by their pid")


def check_families(config: SweepConfig) -> tuple[dict, dict]:
    """resolve_families for `config` (device resolved); SweepError when no family can run."""
    backends, skipped = resolve_families(config.families, config.device)
    if not backends:
        why = "; ".join(f"{f}: {r}" for f, r in skipped.items())
        raise SweepError(f"no kernel family can run on {config.device} ({why})")
    return backends, skipped


class EarlyStart:
    """What a GPU sweep starts before it plans, so that it overlaps the planning's imports
    (FlashInfer, vLLM: ~10 s on the H200): the measuring worker (in a thread: its fork server
    imports torch and the measuring code, then the worker imports the families' kernels), the
    ceilings probe and FlashInfer's background JIT build (jit_prebuild: its modules depend on
    the buckets' head dims and dtypes only, not on a plan). Nothing here writes user data; on
    the CPU, or with isolation inline, nothing starts."""

    def __init__(self, config: SweepConfig, settings):
        import threading
        from mla_tune.measure.worker import make_runner
        self.runner = self.ceilings = self.prebuild = None
        self.error: BaseException | None = None
        self._thread = None
        if not str(config.device).startswith("cuda"):
            return
        self.runner = make_runner(settings, config.isolation, config.timeout_s,
                                  list(config.families or GPU_FAMILIES))
        if "flashinfer" in (config.families or GPU_FAMILIES):
            from mla_tune.measure.jit_prebuild import start_prebuild
            self.prebuild = start_prebuild([b.workload for b in config.buckets])
        if getattr(self.runner, "isolated", False):
            self.ceilings = CeilingsProbe().start()
            self._thread = threading.Thread(target=self._start_worker, name="mla-tune-worker-start",
                                            daemon=True)
            self._thread.start()

    def _start_worker(self) -> None:
        try:
            self.runner.start()
        except BaseException as e:  # noqa: BLE001 - re-raised in the sweep's thread by wait()
            self.error = e

    def wait(self) -> float:
        """Wait for the worker to be up (re-raises its start's error); the seconds waited."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return time.monotonic() - t0

    def close(self) -> None:
        """End what was started (the runner's worker and the probe; the sweep's own finally
        ends the JIT build with the Triton one)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.ceilings is not None:
            self.ceilings.close()
        if self.runner is not None:
            self.runner.close()


def run_sweep(config: SweepConfig, observer: SweepObserver | None = None) -> SweepOutcome:
    """Search every bucket, measuring what the store does not hold yet and committing each trial
    as its batch returns; then choose winners over the swept buckets' trials and emit the config.

    With `time_budget_s`, each bucket gets its share of the time left in proportion to its
    expected cost (`bucket_weight`; first-use JIT, worker start-up and the run's one-time set-up do
    not count against it); buckets cut short are counted in `stopped_early`, and a rerun continues them. Raises SweepError when no kernel family can run here, StoreError for a DB it
    must not touch.
    """
    from mla_tune.problem.roofline import workload_bytes, workload_flops
    from mla_tune.store.results import ResultsStore
    from mla_tune.measure.worker import make_runner

    if config.gpus:
        from mla_tune.tune.distributed import run_workers
        return run_workers(config, list(config.gpus), observer)

    obs = observer or SweepObserver()
    t_start = time.monotonic()
    # every input checked before anything is written; the worker, the ceilings probe and
    # FlashInfer's JIT build start before the families are resolved and planned (EarlyStart)
    config = check_sweep_config(config, families=False)
    _tag_remeasure(config)
    d = default_space(config.device)
    settings = config.settings or measure_settings(config.device, d.samples, d.warmup)
    settings = replace(settings, device=config.device)
    t_checked = time.monotonic()
    early = EarlyStart(config, settings)
    store = None
    heartbeat = triton_prebuild = None
    prebuild = early.prebuild
    planning = {"checks_s": t_checked - t_start}      # planning's own split (time_line)
    try:
        t = time.monotonic()
        planning["early_s"] = t - t_checked
        families = check_families(config)
        planning["families_s"] = time.monotonic() - t
        t = time.monotonic()
        rdb = None
        from mla_tune.tune.distributed import is_rdb_url
        if config.storage and is_rdb_url(config.storage):
            # reached (or refused) before the results DB is made: a bad URL leaves no file behind
            from mla_tune.tune.distributed import open_storage
            rdb = open_storage(config.storage, config.heartbeat_s)
        store = ResultsStore(config.db)
        plan, ctx = plan_sweep(config, store, families)   # check_families raised if none can run
        planning["spaces_s"] = time.monotonic() - t
        t = time.monotonic()
        if plan.kind == "gpu" and ("triton" in plan.families or "split" in plan.families):
            # and the Triton kernels (vLLM's: one specialisation per heads, page and splits; the
            # split family's: per heads, pipe and partials), on a pool
            from mla_tune.measure.jit_prebuild import start_triton_prebuild, triton_jobs
            triton_prebuild = start_triton_prebuild(triton_jobs(
                (p.bucket.workload, p.space.candidates) for p in plan.buckets if len(p.space)))
        device_name = _device_name(plan.device)
        for p in plan.buckets:
            w = p.bucket.workload
            p.workload_id = store.workload_id(w, workload_bytes(w), workload_flops(w))
        storage = rdb or _open_storage(config, plan)
        if getattr(storage, "rebuilt", None):
            outcome_note = (f"the optuna journal {plan.journal} could not be read: set aside as "
                            f"{storage.rebuilt.name}, studies rebuilt from {plan.db}")
            plan.note = f"{plan.note} {outcome_note}".strip()
        if storage is not None:
            from mla_tune.tune.distributed import Heartbeat, _heartbeat_on
            if _heartbeat_on(storage):
                heartbeat = Heartbeat(storage, storage.get_heartbeat_interval())
        outcome = SweepOutcome(plan)
        planning["store_s"] = time.monotonic() - t
        obs.on_start(plan)
        refused = ctx["refused"]
        # how many refusals each bucket's space was built with: a refusal learnt in any earlier
        # bucket drops that candidate from every later one (not only from the next bucket)
        built_with = {i: len(refused) for i in range(len(plan.buckets))}
        runner = early.runner or make_runner(settings, config.isolation, config.timeout_s,
                                             plan.families)
        measurer = _Measurer(store, runner, plan, config, outcome, obs, refused, device_name)
        if plan.kind == "gpu" and any(len(p.space) for p in plan.buckets):
            # the ceilings child and the worker started side by side before planning (neither
            # touches the GPU until the ceilings are measured: the worker waits for its first
            # batch); what is left of their start-up is waited for here
            measurer.ceilings = early.ceilings or CeilingsProbe().start()
            early.ceilings = None
            t_worker = time.monotonic()
            early.wait()
            getattr(runner, "start", lambda: None)()     # a worker that died since: started again
            outcome.time_split["startup_s"] = time.monotonic() - t_worker
        split = outcome.time_split
        split["plan_s"] = max(0.0, time.monotonic() - t_start - split.get("startup_s", 0.0))
        split["planning"] = planning
        end = (time.monotonic() + config.time_budget_s) if config.time_budget_s else None
        weights = [bucket_weight(p) for p in plan.buckets]
        n = len(plan.buckets)
        # workers start at different buckets, so that they meet only where work is left
        first = (config.worker_index * n) // max(1, config.worker_count)
        order = list(range(first, n)) + list(range(first))
        results: dict = {}          # bucket index -> BucketOutcome
        shared: dict = {}           # bucket index -> SharedBucket not finished by this pass
        try:
            for k, i in enumerate(order):
                p = plan.buckets[i]
                if len(refused) != built_with[i]:   # refusals learnt in earlier buckets apply here
                    built_with[i] = len(refused)
                    again = plan_bucket(p.bucket, _space_for(p.bucket, ctx["backends"],
                                                             config.page_sizes, refused), config)
                    p.space, p.mode, p.budget = again.space, again.mode, again.budget
                left = [weights[j] for j in order[k:]]
                share = None if end is None else \
                    time.monotonic() + budget_share(max(0.0, end - time.monotonic()), left)
                policy = config.policy(share)
                evaluate = measurer.evaluator(p, policy)
                obs.on_bucket(p)
                t0 = time.monotonic()
                if storage is not None and len(p.space):
                    sb = _shared_bucket(storage, config, plan, p, ctx["backends"], device_name,
                                        heartbeat, store)
                    if p.mode == "grid":
                        so = SearchOutcome("grid", len(p.space), p.budget)
                        _claim_and_measure(sb, so, evaluate, policy)
                    else:   # optuna's distributed TPE: every worker asks the one study
                        so = search(p.space, evaluate, policy, shared=sb)
                    results[i] = BucketOutcome(p, so, time.monotonic() - t0)
                    if sb.counts()["running"]:      # other workers hold some of its trials
                        shared[i] = sb
                        continue
                    _add_finished_elsewhere(sb, so, outcome)
                else:
                    so = search(p.space, evaluate, policy, _study_name(config, p.bucket), None)
                    results[i] = BucketOutcome(p, so, time.monotonic() - t0)
                outcome.stopped_early += so.stopped == "time budget"
                obs.on_bucket_done(results[i])
            # what other workers hold: wait for it, and measure it here if its worker dies
            while shared:
                if end is not None and time.monotonic() > end:
                    break
                time.sleep(POLL_S)
                for i, sb in list(shared.items()):
                    bo = results[i]
                    pol = config.policy(end)
                    _claim_and_measure(sb, bo.search, measurer.evaluator(bo.planned, pol), pol)
                    if not sb.counts()["running"]:
                        del shared[i]
                        _add_finished_elsewhere(sb, bo.search, outcome)
                        obs.on_bucket_done(bo)
            for i, sb in shared.items():   # the time budget ran out while others measured
                _add_finished_elsewhere(sb, results[i].search, outcome)
                outcome.stopped_early += 1
                obs.on_bucket_done(results[i])
            outcome.buckets = [results[i] for i in sorted(results)]
        finally:
            outcome.faults = getattr(runner, "faults", 0)
            outcome.restarts = getattr(runner, "restarts", 0)
            if measurer.ceilings is not None:
                measurer.ceilings.close()
            runner.close()
        if config.role == "worker":       # the launcher chooses and emits, once, after its workers
            outcome.seconds = time.monotonic() - t_start
            return outcome
        t_choose = time.monotonic()
        outcome.rows = _rows_for(store, [p.workload_id for p in plan.buckets], device_name)
        outcome.choice = _choose(outcome.rows, config, device_name)
        if config.emit and outcome.choice is not None:
            outcome.emitted, outcome.emit_note = emit_tuned_config(outcome, config, store)
        elif outcome.choice is not None and plan.kind == "cpu-reference":
            outcome.emit_note = (f"no tuned config written: the CPU reference is not a serving "
                                 f"device (--emit --configs-dir DIR writes one); the trials are "
                                 f"in {config.db}")
        outcome.seconds = time.monotonic() - t_start
        split["choose_s"] = time.monotonic() - t_choose
        obs.on_done(outcome)
        return outcome
    except Exception as e:
        from mla_tune import faults
        if faults.is_fault(e):       # a full disk, a folder turned read-only: one line, resumable
            raise SweepError(faults.sweep_stopped(e, config.db)) from None
        raise
    finally:
        early.close()            # the worker and the probe, whether or not the sweep got to them
        for proc in (prebuild, triton_prebuild):
            if proc is not None:
                from mla_tune.measure.jit_prebuild import finish_prebuild
                finish_prebuild(proc)
        if heartbeat is not None:
            heartbeat.close()
        if store is not None:
            store.close()


POLL_S = 0.5     # how often a worker looks again at trials that other workers hold


def _claim_and_measure(sb, so: SearchOutcome, evaluate, policy: SearchPolicy) -> None:
    """Claim batches of bucket `sb`'s waiting trials and measure them, until none is left or the
    policy's deadline passes; every evaluation goes to `so` and back to the study."""
    while True:
        if policy.deadline is not None and time.monotonic() >= policy.deadline:
            if sb.counts()["waiting"]:
                so.stopped = "time budget"
            return
        sb.fail_stale()          # a dead worker's trial is waiting again (optuna's retry)
        claims = sb.claim(policy.batch)
        if not claims:
            return
        evs = evaluate([c.candidate for c in claims], [c.key(sb.uid) for c in claims])
        so.proposals += len(claims)
        for c, ev in zip(claims, evs):
            sb.finish(c, ev)
            so.evaluations.append(ev)


def _add_finished_elsewhere(sb, so: SearchOutcome, outcome: SweepOutcome) -> None:
    """The bucket's candidates that other workers (or an earlier run) finished, as evaluations
    answered from the shared study, so the outcome covers the whole bucket."""
    have = {e.candidate.key for e in so.evaluations}
    for key, (value, reason, tid) in sb.finished().items():
        if key not in have:
            so.evaluations.append(Evaluation(sb._candidate(key), value, True, reason, tid))
            outcome.cached += 1
    if sb.counts()["waiting"]:
        so.stopped = "time budget"
    elif so.mode == "grid":
        so.stopped = "complete" if so.budget >= so.space_size else "trial budget"


def _note_best(best: list, ev: Evaluation) -> None:
    if ev.ok and (best[0] is None or ev.value < best[0].value):
        best[0] = ev


def _cached(store, workload_id: int, device_name: str) -> dict:
    """candidate key -> latest trial row of this workload on this device."""
    out = {}
    for r in store.trials("t.workload_id = ? and r.device_name = ?", [workload_id, device_name]):
        out[r["candidate"]] = r
    return out


def _rows_for(store, workload_ids: list, device_name: str) -> list:
    rows = []
    ids = sorted(set(i for i in workload_ids if i is not None))
    for k in range(0, len(ids), 500):
        chunk = ids[k:k + 500]
        rows += store.trials(f"t.workload_id in ({','.join('?' * len(chunk))}) and r.device_name = ?",
                             [*chunk, device_name])
    return rows


def _choose(rows: list, config: SweepConfig, device_name: str):
    from mla_tune.tune.choose import choose
    if not rows:
        return None
    return choose(rows, config.mix, device_name=device_name, p_threshold=config.p_threshold,
                  min_ratio=config.min_ratio)


def emit_tuned_config(outcome: SweepOutcome, config: SweepConfig, store=None) -> tuple[Path | None, str]:
    """Write the tuned config of `outcome.choice` through mla_tune.tune.emit.emit_config (the report
    side's writer), if that module is installed; (path, "") or (None, why not)."""
    try:
        from mla_tune.tune import emit
    except ImportError:
        return None, "mla_tune.tune.emit is not available: no tuned config written"
    fn = getattr(emit, "emit_config", None)
    if fn is None:
        return None, "mla_tune.tune.emit has no emit_config: no tuned config written"
    try:
        # config.emit is True here: for the CPU reference that was asked for explicitly
        path = fn(outcome.choice, config.configs_dir, store=store, mix=config.mix, cpu_ok=True)
    except Exception as e:  # noqa: BLE001 - the trials are stored; the config can be emitted later
        return None, (f"no tuned config written ({type(e).__name__}: {e}); the trials are stored: "
                      f"`mla-tune emit --db {config.db}` writes it later")
    return (Path(path) if path else None), ""


# names that live in replay.py and sweep_flags.py (which import this module), served from here
_ELSEWHERE = {"replay_sweep": "replay", "stored_buckets": "replay", "build_config": "sweep_flags",
              "estimate_note": "sweep_flags"}


def __getattr__(name):
    if name in _ELSEWHERE:
        from importlib import import_module
        return getattr(import_module(f"mla_tune.tune.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the lazy names of _ELSEWHERE included
__all__ = ["Bucket", "BucketOutcome", "CPU_REFERENCE_NOTE", "DefaultSpace", "PlannedBucket",  # noqa: F822
           "SweepConfig", "SweepError", "SweepInputError", "SweepObserver", "SweepOutcome", "SweepPlan",
           "build_config", "measure_settings", "default_space", "detect_device", "emit_tuned_config",
           "estimate_note", "journal_path_for", "check_sweep_config", "check_families", "default_db", "parse_duration",
           "parse_sizes", "plan_bucket", "plan_buckets", "plan_sweep", "resolve_lengths",
           "replay_sweep", "resolve_families", "run_sweep", "stored_buckets"]
