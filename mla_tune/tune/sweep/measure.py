"""A sweep's measuring side: answers a bucket's candidates from the store (measured before on
this device, or a claim another worker stored), or measures them in the runner and commits each
trial; keeps the time split (JIT, samples, worker start-up) the sweep reports."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

from mla_tune import fault_points
from mla_tune.families.base import Candidate
from mla_tune.measure.environment import capture_environment
from mla_tune.problem.defaults import KERNEL_METRIC
from mla_tune.store.selection import profile_clause
from mla_tune.tune.search import Evaluation, SearchPolicy
from mla_tune.tune.sweep.config import SweepConfig
from mla_tune.tune.sweep.outcome import SweepObserver, SweepOutcome
from mla_tune.tune.sweep.plan import PlannedBucket, SweepPlan, unsupported_key
from mla_tune.tune.sweep.start import CeilingsProbe, ceilings_in_subprocess

JIT_S = 0.5      # a preparation longer than this is first-use compilation, not the bucket's search


class Measurer:
    """Answers a bucket's candidates from the store, or measures them and commits each trial."""

    def __init__(self, store, runner, plan: SweepPlan, config: SweepConfig, outcome: SweepOutcome,
                 obs: SweepObserver, refused: dict, device_name: str):
        self.store, self.runner, self.plan, self.config = store, runner, plan, config
        self.outcome, self.obs, self.refused, self.device_name = outcome, obs, refused, device_name
        self.run_id: int | None = None
        self.ceilings: CeilingsProbe | None = None     # started early on a GPU (start)
        self.first_round = True     # the sweep's first round trip to the worker is still to come

    def _run(self) -> int:
        if self.run_id is None:     # a rerun that measures nothing adds no run record
            env = capture_environment(self.plan.kind, self.config.command, self.plan.profile or None)
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
        cache = {} if self.config.remeasure else _cached(self.store, p.workload_id, self.device_name,
                                                          self.plan.profile)
        best: list = [None]

        def evaluate(cands: list[Candidate], claims: list[str] | None = None) -> list[Evaluation]:
            claim_of = dict(zip((c.key for c in cands), claims or ()))
            evs, todo = self._answer_stored(p, best, cands, claim_of, cache)
            if todo:
                evs.update(self._measure(p, best, policy, todo, claim_of))
            return [evs[c.key] for c in cands]

        return evaluate

    def _answer_stored(self, p: PlannedBucket, best: list, cands: list[Candidate], claim_of: dict,
                       cache: dict) -> tuple[dict, list]:
        """(candidate key -> Evaluation of those the store answers, the candidates left to measure)."""
        evs: dict[str, Evaluation] = {}
        todo = []
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
                c, kernel_median(row["samples"], ok), True, row["invalid_reason"], row["id"]))
            self.outcome.cached += 1
        return evs, todo

    def _measure(self, p: PlannedBucket, best: list, policy: SearchPolicy, todo: list[Candidate],
                 claim_of: dict) -> dict:
        """Measure `todo` in the runner and commit each trial (candidate key -> Evaluation); the
        worker's start-up, first-use JIT and the sweep's first round trip move policy.deadline on."""
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
        results = self.runner.measure(p.bucket.workload, todo,
                                      lambda c, ok: self._prepared(p, c, ok))
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
        evs = {}
        for c, r in zip(todo, results):
            ev = self._commit(p, run_id, c, r, started, claim_of.get(c.key))
            jit_in_round += self._account(r, policy)
            evs[c.key] = self._report(p, best, ev)
            self.outcome.measured += 1
        if first_round and policy.deadline is not None:
            policy.deadline += max(0.0, time.monotonic() - t_measure - started_s - jit_in_round)
        return evs

    def _prepared(self, p: PlannedBucket, c: Candidate, ok: bool) -> None:
        fault_points.at("trial-prepared", self.store.path)    # a trial in flight, none stored
        self.obs.on_prepared(p, c, ok)

    def _commit(self, p: PlannedBucket, run_id: int, c: Candidate, r, started: str,
                claim: str | None) -> Evaluation:
        """Store one result as a trial; its Evaluation. A refusal is learnt for later buckets."""
        w = p.bucket.workload
        tid = self.store.add_trial(
            run_id, p.workload_id, c, r.status, r.samples or None,
            invalid_reason=r.invalid_reason, message=r.message, compile_s=r.compile_s,
            max_rel_error=r.max_rel_error, sweep=self.config.name, started_at=started,
            is_default=c in p.space.defaults, claim=claim)
        ok = r.status == "ok"
        ev = Evaluation(c, kernel_median(r.samples, ok), False, r.invalid_reason, tid)
        if ok and ev.value is None:
            ev = replace(ev, reason="runtime")
        if r.invalid_reason == "unsupported":
            first = (r.message or "").splitlines()[0][:200] if r.message else ""
            self.refused.setdefault(unsupported_key(c, w), (w.label(), first))
        return ev

    def _account(self, r, policy: SearchPolicy) -> float:
        """One result's times added to the sweep's time split; its first-use JIT seconds (0 when
        none), by which policy.deadline moves on."""
        split = self.outcome.time_split
        jit = 0.0
        if (r.compile_s or 0) > JIT_S:
            jit = r.compile_s
            split["jit_s"] = split.get("jit_s", 0.0) + jit
            if policy.deadline is not None:
                policy.deadline += jit
        split["samples_s"] = split.get("samples_s", 0.0) + sum(
            (r.samples or {}).get(KERNEL_METRIC) or ()) / 1e6
        for k, v in (getattr(r, "phase_s", None) or {}).items():
            split[k] = split.get(k, 0.0) + v
        return jit

    def _report(self, p, best: list, ev: Evaluation) -> Evaluation:
        note_best(best, ev)
        self.obs.on_trial(p, ev, best[0])
        return ev


def note_best(best: list, ev: Evaluation) -> None:
    """Keep the fastest valid evaluation so far in best[0] (what an observer shows as best)."""
    if ev.ok and (best[0] is None or ev.value < best[0].value):
        best[0] = ev


def _cached(store, workload_id: int, device_name: str, profile: str = "") -> dict:
    """candidate key -> latest trial row of this workload on this device, measured under
    `profile` (one key may run another kernel under another target's profile)."""
    where, args = "t.workload_id = ? and r.device_name = ?", [workload_id, device_name]
    if profile:
        clause, more = profile_clause(profile)
        where, args = f"{where} and {clause}", args + more
    out = {}
    for r in store.trials(where, args):
        out[r["candidate"]] = r
    return out


def kernel_median(row_or_result_samples: dict | None, ok: bool) -> float | None:
    """The value the search minimises: the median kernel time of valid samples (None otherwise)."""
    xs = (row_or_result_samples or {}).get(KERNEL_METRIC) or []
    return float(statistics.median(xs)) if ok and xs else None

