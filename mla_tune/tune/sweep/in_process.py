"""A sweep in this process (the only one, or one worker of `--gpus`): check, start the worker
early, plan, search every bucket measuring what the store does not hold yet, then choose and
emit (finish). Every trial is committed as its batch returns; rerunning is a resume.

With `time_budget_s`, each bucket gets its share of the time left in proportion to its expected
cost (plan.bucket_weight; first-use JIT, worker start-up and the run's one-time set-up do
not count against it); buckets cut short are counted in `stopped_early`, and a rerun continues them.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mla_tune import faults
from mla_tune.measure.jit_prebuild import finish_prebuild, start_triton_prebuild, triton_jobs
from mla_tune.measure.worker import make_runner
from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.store.results import ResultsStore
from mla_tune.tune.search import SearchOutcome, search
from mla_tune.tune.study_storage import heartbeat_on, is_rdb_url, open_storage
from mla_tune.tune.sweep.buckets import default_space, measure_settings
from mla_tune.tune.sweep.check import check_families, check_sweep_config
from mla_tune.tune.sweep.config import SweepConfig, SweepError, sweep_profile
from mla_tune.tune.sweep.finish import finish_sweep
from mla_tune.tune.sweep.measure import Measurer
from mla_tune.tune.sweep.outcome import BucketOutcome, SweepObserver, SweepOutcome
from mla_tune.tune.sweep.plan import (bucket_weight, budget_share, device_name_of, plan_bucket,
                                      plan_sweep, space_for, study_name, tag_remeasure)
from mla_tune.tune.sweep.shared import (POLL_S, add_finished_elsewhere, claim_and_measure,
                                        open_sweep_storage, shared_bucket)
from mla_tune.tune.sweep.shared_bucket import Heartbeat
from mla_tune.tune.sweep.start import CeilingsProbe, EarlyStart


def run_in_process(config: SweepConfig, observer: SweepObserver | None = None) -> SweepOutcome:
    """Search every bucket in this process, measuring what the store does not hold yet and
    committing each trial as its batch returns; then (unless a worker of several) choose winners
    over the swept buckets' trials and emit the config. Raises SweepError when no kernel family
    can run here, StoreError for a DB it must not touch."""
    run = _LiveSweep(config, observer or SweepObserver())
    try:
        run.open()
        try:
            run.search()
        finally:
            run.stop_measuring()
        return run.finish()
    except Exception as e:
        if faults.is_fault(e):       # a full disk, a folder turned read-only: one line, resumable
            raise SweepError(faults.sweep_stopped(e, run.config.db)) from None
        raise
    finally:
        run.close()


class _LiveSweep:
    """One process's sweep in progress: what it has opened (store, shared storage, heartbeat,
    worker, probe, JIT builds) and what it has found, phase by phase."""

    def __init__(self, config: SweepConfig, obs: SweepObserver):
        self.obs = obs
        self.t_start = time.monotonic()
        # every input checked before anything is written; the worker, the ceilings probe and
        # FlashInfer's JIT build start before the families are resolved and planned (EarlyStart)
        config = check_sweep_config(config, families=False)
        tag_remeasure(config)
        d = default_space(config.device)
        settings = config.settings or measure_settings(config.device, d.samples, d.warmup)
        self.config, self.settings = config, replace(settings, device=config.device,
                                                     profile=sweep_profile(config).name)
        t_checked = time.monotonic()
        self.early = EarlyStart(config, self.settings)
        self.store = self.rdb = self.storage = self.heartbeat = self.triton_prebuild = None
        self.plan = self.ctx = self.device_name = self.outcome = None
        self.runner = self.measurer = None
        self.end: float | None = None     # the time budget's deadline (time.monotonic())
        self.planning = {"checks_s": t_checked - self.t_start,       # planning's own split (time_line)
                         "early_s": time.monotonic() - t_checked}
        self.results: dict = {}          # bucket index -> BucketOutcome
        self.shared: dict = {}           # bucket index -> SharedBucket not finished by this pass

    # ------------------------------------------------------------ planning
    def open(self) -> None:
        """Families, store, plan, shared storage and the measuring side, all before any bucket."""
        t = time.monotonic()
        families = check_families(self.config)
        self.planning["families_s"] = time.monotonic() - t
        t = time.monotonic()
        self._plan(families)
        self.planning["spaces_s"] = time.monotonic() - t
        t = time.monotonic()
        self._workloads_and_studies()
        self.outcome = SweepOutcome(self.plan)
        self.planning["store_s"] = time.monotonic() - t
        self.obs.on_start(self.plan)
        self._start_measuring()
        split = self.outcome.time_split
        split["plan_s"] = max(0.0, time.monotonic() - self.t_start - split.get("startup_s", 0.0))
        split["planning"] = self.planning

    def _plan(self, families: tuple) -> None:
        """The RDB storage reached, the results DB opened, every bucket's space planned."""
        config = self.config
        if config.storage and is_rdb_url(config.storage):
            # reached (or refused) before the results DB is made: a bad URL leaves no file behind
            self.rdb = open_storage(config.storage, config.heartbeat_s)
        self.store = ResultsStore(config.db)
        self.plan, self.ctx = plan_sweep(config, self.store, families)   # check_families: one runs

    def _workloads_and_studies(self) -> None:
        """The Triton prebuild, every bucket's workload row, the shared storage and heartbeat."""
        plan = self.plan
        if plan.kind == "gpu" and ("triton" in plan.families or "split" in plan.families):
            # and the Triton kernels (vLLM's: one specialisation per heads, page and splits; the
            # split family's: per heads, pipe and partials), on a pool
            self.triton_prebuild = start_triton_prebuild(triton_jobs(
                ((p.bucket.workload, p.space.candidates) for p in plan.buckets if len(p.space)),
                plan.profile or None))
        self.device_name = device_name_of(plan.device)
        for p in plan.buckets:
            w = p.bucket.workload
            p.workload_id = self.store.workload_id(w, workload_bytes(w), workload_flops(w))
        self.storage = storage = self.rdb or open_sweep_storage(self.config, plan)
        if getattr(storage, "rebuilt", None):
            note = (f"the optuna journal {plan.journal} could not be read: set aside as "
                    f"{storage.rebuilt.name}, studies rebuilt from {plan.db}")
            plan.note = f"{plan.note} {note}".strip()
        if storage is not None:
            if heartbeat_on(storage):
                self.heartbeat = Heartbeat(storage, storage.get_heartbeat_interval())

    def _start_measuring(self) -> None:
        """The runner (the early-started worker, or one made now) and the Measurer; on a GPU the
        ceilings probe, and what is left of the worker's start-up is waited for here."""
        plan, early = self.plan, self.early
        self.runner = early.runner or make_runner(self.settings, self.config.isolation,
                                                  self.config.timeout_s, plan.families)
        self.measurer = Measurer(self.store, self.runner, plan, self.config, self.outcome, self.obs,
                                 self.ctx["refused"], self.device_name)
        if plan.kind == "gpu" and any(len(p.space) for p in plan.buckets):
            # the ceilings child and the worker started side by side before planning (neither
            # touches the GPU until the ceilings are measured: the worker waits for its first
            # batch); what is left of their start-up is waited for here
            self.measurer.ceilings = early.ceilings or CeilingsProbe().start()
            early.ceilings = None
            t_worker = time.monotonic()
            early.wait()
            getattr(self.runner, "start", lambda: None)()     # a worker that died since: started again
            self.outcome.time_split["startup_s"] = time.monotonic() - t_worker

    # ------------------------------------------------------------ searching
    def search(self) -> None:
        """Every bucket once, this worker starting at its own (workers meet only where work is
        left), then the buckets other workers still hold."""
        config, plan = self.config, self.plan
        refused = self.ctx["refused"]
        # how many refusals each bucket's space was built with: a refusal learnt in any earlier
        # bucket drops that candidate from every later one (not only from the next bucket)
        built_with = {i: len(refused) for i in range(len(plan.buckets))}
        self.end = (time.monotonic() + config.time_budget_s) if config.time_budget_s else None
        weights = [bucket_weight(p) for p in plan.buckets]
        n = len(plan.buckets)
        first = (config.worker_index * n) // max(1, config.worker_count)
        order = list(range(first, n)) + list(range(first))
        for k, i in enumerate(order):
            p = plan.buckets[i]
            if len(refused) != built_with[i]:   # refusals learnt in earlier buckets apply here
                built_with[i] = len(refused)
                again = plan_bucket(p.bucket, space_for(p.bucket, self.ctx["backends"],
                                                        config.page_sizes, refused), config)
                p.space, p.mode, p.budget = again.space, again.mode, again.budget
            left = [weights[j] for j in order[k:]]
            share = None if self.end is None else \
                time.monotonic() + budget_share(max(0.0, self.end - time.monotonic()), left)
            self._search_bucket(i, config.policy(share))
        self._wait_for_others()
        self.outcome.buckets = [self.results[i] for i in sorted(self.results)]

    def _search_bucket(self, i: int, policy) -> None:
        """Bucket i searched under `policy`: in its shared study when there is a storage (left
        in self.shared while other workers hold some of its trials), else in memory."""
        p = self.plan.buckets[i]
        evaluate = self.measurer.evaluator(p, policy)
        self.obs.on_bucket(p)
        t0 = time.monotonic()
        if self.storage is not None and len(p.space):
            sb = shared_bucket(self.storage, self.config, self.plan, p, self.ctx["backends"],
                               self.device_name, self.heartbeat, self.store)
            if p.mode == "grid":
                so = SearchOutcome("grid", len(p.space), p.budget)
                claim_and_measure(sb, so, evaluate, policy)
            else:   # optuna's distributed TPE: every worker asks the one study
                so = search(p.space, evaluate, policy, shared=sb)
            self.results[i] = BucketOutcome(p, so, time.monotonic() - t0)
            if sb.counts()["running"]:      # other workers hold some of its trials
                self.shared[i] = sb
                return
            add_finished_elsewhere(sb, so, self.outcome)
        else:
            so = search(p.space, evaluate, policy, study_name(self.config, p.bucket), None)
            self.results[i] = BucketOutcome(p, so, time.monotonic() - t0)
        self.outcome.stopped_early += so.stopped == "time budget"
        self.obs.on_bucket_done(self.results[i])

    def _wait_for_others(self) -> None:
        """What other workers hold: wait for it, and measure it here if its worker dies."""
        while self.shared:
            if self.end is not None and time.monotonic() > self.end:
                break
            time.sleep(POLL_S)
            for i, sb in list(self.shared.items()):
                bo = self.results[i]
                pol = self.config.policy(self.end)
                claim_and_measure(sb, bo.search, self.measurer.evaluator(bo.planned, pol), pol)
                if not sb.counts()["running"]:
                    del self.shared[i]
                    add_finished_elsewhere(sb, bo.search, self.outcome)
                    self.obs.on_bucket_done(bo)
        for i, sb in self.shared.items():   # the time budget ran out while others measured
            add_finished_elsewhere(sb, self.results[i].search, self.outcome)
            self.outcome.stopped_early += 1
            self.obs.on_bucket_done(self.results[i])

    # ------------------------------------------------------------ the end
    def stop_measuring(self) -> None:
        """The runner's counts into the outcome; the probe and the runner closed."""
        self.outcome.faults = getattr(self.runner, "faults", 0)
        self.outcome.restarts = getattr(self.runner, "restarts", 0)
        if self.measurer.ceilings is not None:
            self.measurer.ceilings.close()
        self.runner.close()

    def finish(self) -> SweepOutcome:
        """Choose and emit (not in a worker: the launcher does, once, after its workers)."""
        outcome = self.outcome
        if self.config.role == "worker":
            outcome.seconds = time.monotonic() - self.t_start
            return outcome
        t_choose = time.monotonic()
        finish_sweep(outcome, self.config, self.store, self.device_name)
        outcome.seconds = time.monotonic() - self.t_start
        outcome.time_split["choose_s"] = time.monotonic() - t_choose
        self.obs.on_done(outcome)
        return outcome

    def close(self) -> None:
        """Everything this sweep started, whether or not it got to use it."""
        self.early.close()            # the worker and the probe
        for proc in (self.early.prebuild, self.triton_prebuild):
            if proc is not None:
                finish_prebuild(proc)
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.store is not None:
            self.store.close()
