"""A sweep's buckets as studies in a shared optuna storage (a journal file or an RDB), so that
several workers measure every candidate once: the storage, each bucket's study (created and
seeded by the first process), claiming and measuring a grid's waiting trials, and what other
workers finished."""

from __future__ import annotations

import time

from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.store.results import ResultsStore
from mla_tune.tune.search import Evaluation, SearchOutcome, SearchPolicy, tpe_sampler
from mla_tune.tune.study_storage import open_storage
from mla_tune.tune.sweep.config import SweepConfig, SweepError, SweepInputError
from mla_tune.tune.sweep.outcome import SweepOutcome
from mla_tune.tune.sweep.plan import (PlannedBucket, SweepPlan, device_name_of, plan_sweep, space_for,
                                      study_name, tag_remeasure)
from mla_tune.tune.sweep.shared_bucket import SharedBucket

POLL_S = 0.5     # how often a worker looks again at trials that other workers hold


def open_sweep_storage(config: SweepConfig, plan: SweepPlan):
    """The optuna storage the plan's studies live in (None: in memory)."""
    if config.storage:
        return open_storage(config.storage, config.heartbeat_s)
    return open_storage(plan.journal) if plan.journal else None


def shared_bucket(storage, config: SweepConfig, plan: SweepPlan, p: PlannedBucket, backends: dict,
                  device_name: str, heartbeat=None, store=None):
    """Bucket p's study in the shared storage, created and seeded if no other process has done
    so: with its grid (in measuring order, cut to its budget), or for TPE with the family
    defaults (TPE proposes the rest). With `store` (the results DB a journal belongs to), the
    study is checked against the DB: what it says was measured and the DB lacks is measured again."""
    declared = space_for(p.bucket, backends, config.page_sizes, {})
    name = f"{study_name(config, p.bucket, declared)} | {p.mode} | {device_name}"
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
    tag_remeasure(config)
    with ResultsStore(config.db) as store:
        plan, ctx = plan_sweep(config, store)
        if not plan.families:
            why = "; ".join(f"{f}: {r}" for f, r in plan.skipped.items())
            raise SweepError(f"no kernel family can run on {plan.device} ({why})")
        for p in plan.buckets:
            w = p.bucket.workload
            p.workload_id = store.workload_id(w, workload_bytes(w), workload_flops(w))
    storage = open_sweep_storage(config, plan)
    if storage is None:
        raise SweepInputError("several workers need a shared optuna storage (--storage or a journal)")
    device_name = device_name_of(plan.device)
    return sum(shared_bucket(storage, config, plan, p, ctx["backends"], device_name).created
               for p in plan.buckets if len(p.space))


def claim_and_measure(sb, so: SearchOutcome, evaluate, policy: SearchPolicy) -> None:
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


def add_finished_elsewhere(sb, so: SearchOutcome, outcome: SweepOutcome) -> None:
    """The bucket's candidates that other workers (or an earlier run) finished, as evaluations
    answered from the shared study, so the outcome covers the whole bucket."""
    have = {e.candidate.key for e in so.evaluations}
    for key, (value, reason, tid) in sb.finished().items():
        if key not in have:
            so.evaluations.append(Evaluation(sb.candidate(key), value, True, reason, tid))
            outcome.cached += 1
    if sb.counts()["waiting"]:
        so.stopped = "time budget"
    elif so.mode == "grid":
        so.stopped = "complete" if so.budget >= so.space_size else "trial budget"

