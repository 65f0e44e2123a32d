"""Replay: the sweep's search run over measurements stored in a results DB, measuring nothing
(`mla-tune sweep --replay`): does a search (TPE, a smaller budget) reach the winners the full
grid found? Writes nothing."""

from __future__ import annotations

import time
from pathlib import Path

from mla_tune.families.base import Candidate
from mla_tune.problem.workload import Workload
from mla_tune.store.results import ResultsStore
from mla_tune.store.selection import profile_clause
from mla_tune.tune.choose import family_default, latest_trials, tp_size_of
from mla_tune.tune.search import Evaluation, search
from mla_tune.tune.search_space import SearchSpace
from mla_tune.tune.sweep.buckets import Bucket
from mla_tune.tune.sweep.check import check_search_settings
from mla_tune.tune.sweep.config import SweepConfig, SweepInputError
from mla_tune.tune.sweep.finish import choose_winners
from mla_tune.tune.sweep.measure import kernel_median, note_best
from mla_tune.tune.sweep.outcome import BucketOutcome, SweepObserver, SweepOutcome
from mla_tune.tune.sweep.plan import SweepPlan, plan_bucket, study_name


def stored_buckets(rows: list) -> list[Bucket]:
    """The buckets a set of trial rows covers, in a stable order."""
    seen = {}
    for r in rows:
        if r["workload_id"] in seen:
            continue
        w = Workload.from_row(r)
        seen[r["workload_id"]] = Bucket(r["model"], tp_size_of(r["model"], r["num_heads"]), w)
    return sorted(seen.values(), key=lambda b: (b.model, -b.workload.num_heads, b.workload.q_len,
                                                b.workload.batch_size, b.workload.context_len))


def replay_sweep(source: str | Path, config: SweepConfig, observer: SweepObserver | None = None,
                 device_name: str | None = None, where=None) -> SweepOutcome:
    """Run the same search over measurements stored in `source`, measuring nothing.

    Each bucket's space is what was stored for its workload (defaults from the is_default mark);
    a proposal is answered with its stored trial. `config.buckets` empty means every stored
    workload, narrowed by `where(bucket) -> bool` if given. The choice is made over the trials the
    search visited, so a replay shows whether a search (TPE, a smaller budget) reaches the winners
    that the full grid found. Writes nothing.
    """
    obs = observer or SweepObserver()
    t_start = time.monotonic()
    check_search_settings(config)
    rows, device_name = _stored_rows(source, device_name, config.profile)
    by_workload: dict = {}
    for r in rows:
        by_workload.setdefault(_workload_key_of(r), []).append(r)
    plan = _replay_plan(source, config, rows, by_workload, device_name, where)
    outcome = SweepOutcome(plan)
    obs.on_start(plan)
    visited: list = []
    for p in plan.buckets:
        stored = {r["candidate"]: r for r in by_workload[tuple(sorted(p.bucket.workload.key.items()))]}
        obs.on_bucket(p)
        evaluate = _evaluate_stored(stored, p, obs, visited, outcome)
        t0 = time.monotonic()
        so = search(p.space, evaluate, config.policy(None), study_name(config, p.bucket), None)
        bo = BucketOutcome(p, so, time.monotonic() - t0)
        outcome.buckets.append(bo)
        obs.on_bucket_done(bo)
    outcome.rows = visited
    outcome.choice = choose_winners(visited, config, device_name)
    outcome.seconds = time.monotonic() - t_start
    obs.on_done(outcome)
    return outcome


def _stored_rows(source, device_name: str | None, profile: str | None = None) -> tuple[list, str]:
    """The latest stored trial of each candidate in `source` of one device (the one named, or
    the only one), and that device's name; measured under `profile`, where given."""
    with ResultsStore(source, create=False) as store:
        rows = latest_trials(store.trials(*(profile_clause(profile) if profile else ("1=1", ()))))
    devices = sorted({r["device_name"] for r in rows})
    if device_name is None:
        if len(devices) > 1:
            raise SweepInputError(f"{source} holds trials of several devices ({', '.join(devices)}); "
                             "pick one with --device-name")
        device_name = devices[0] if devices else ""
    rows = [r for r in rows if r["device_name"] == device_name]
    if not rows:
        raise SweepInputError(f"{source} holds no trials" + (f" of device {device_name!r}" if device_name else ""))
    return rows, device_name


def _replay_plan(source, config: SweepConfig, rows: list, by_workload: dict, device_name: str,
                 where) -> SweepPlan:
    """Every requested bucket that `source` holds, planned over its stored candidates."""
    buckets = list(config.buckets) or stored_buckets(rows)
    if where is not None:
        buckets = [b for b in buckets if where(b)]
    planned, missing = [], []
    for b in buckets:
        brows = by_workload.get(tuple(sorted(b.workload.key.items())))
        if not brows:
            missing.append(b.label)
            continue
        cands = {r["candidate"]: Candidate(r["family"], r["backend"], r["page_size"], r["params"]) for r in brows}
        defaults = [cands[r["candidate"]] for r in brows if r.get("is_default")]
        if not defaults:
            defaults = _defaults_from_backends(b, brows, cands)
        planned.append(plan_bucket(b, SearchSpace.build(list(cands.values()), defaults), config,
                                   brows[0]["workload_id"], len(planned)))
    kind = rows[0].get("run_kind") or ""
    plan = SweepPlan(device_name, kind, sorted({r["family"] for r in rows}),
                     {f"({len(missing)} buckets)": "not in the replay DB: " + ", ".join(missing[:5])
                      + (" ..." if len(missing) > 5 else "")} if missing else {},
                     planned, f"replaying {source}: nothing is measured", Path(source), None, True)
    if not planned:
        raise SweepInputError(f"none of the requested buckets is stored in {source}")
    if config.mix is not None:       # before anything is shown: every weighted bucket is replayed
        config.mix.check_covers({(p.bucket.workload.batch_size, p.bucket.workload.context_len)
                                 for p in planned}, f"the buckets replayed from {source}")
    return plan


def _evaluate_stored(stored: dict, p, obs: SweepObserver, visited: list, outcome: SweepOutcome):
    """The search's evaluate(candidates) for bucket p: each answered by its stored trial (which
    the choice is then made over), counted as measured."""
    best: list = [None]

    def evaluate(cands):
        out = []
        for c in cands:
            r = stored[c.key]
            ok = r["status"] == "ok"
            ev = Evaluation(c, kernel_median(r["samples"], ok), False, r["invalid_reason"], r["id"])
            visited.append(r)
            outcome.measured += 1
            note_best(best, ev)
            obs.on_trial(p, ev, best[0])
            out.append(ev)
        return out

    return evaluate


def _workload_key_of(r: dict) -> tuple:
    keys = ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "softmax_scale", "batch_size",
            "context_len", "q_len", "ragged", "seed", "q_dtype", "kv_dtype", "model")
    return tuple(sorted((k, r[k]) for k in keys))


def _defaults_from_backends(b: Bucket, brows: list, cands: dict) -> list:
    out = []
    for fam, page in sorted({(r["family"], r["page_size"]) for r in brows}):
        key = family_default(fam, b.workload, page)
        if key in cands:
            out.append(cands[key])
    return out



__all__ = ["replay_sweep", "stored_buckets"]
