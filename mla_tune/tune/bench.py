"""`mla-tune bench`: measure a given list of candidates on given workloads, no search; every
trial (raw samples included) goes to the results DB like a sweep's, under sweep name "bench"."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_tune.families import Candidate, check_candidate, get_family
from mla_tune.measure.environment import capture_environment
from mla_tune.measure.timing import default_pool_bytes
from mla_tune.measure.trial import MeasureSettings, TrialResult, measure_interleaved
from mla_tune.problem.defaults import KERNEL_METRIC, PLAN_METRIC
from mla_tune.problem.roofline import achieved, measure_ceilings, pct_of_floor, workload_bytes, workload_flops
from mla_tune.problem.workload import RAGGED_KINDS, custom_model, model_preset, workload_for
from mla_tune.store.results import ResultsStore
from mla_tune.store.selection import CPU_RUN_KIND, GPU_RUN_KIND
from mla_tune.store.sqlite_file import is_results_db
from mla_tune.store.stats import stats_of
from mla_tune.validate import InputError, check_kv_tokens, output_file


@dataclass(frozen=True)
class BenchDefaults:
    """What `mla-tune bench` measures when not told: one GPU-sized workload, or on the CPU a
    small one the torch reference answers in seconds (not B32 L4K at 128 heads: minutes)."""

    tp: int
    batches: str
    contexts: str
    samples: int


BENCH_DEFAULTS = {"cuda": BenchDefaults(tp=1, batches="32", contexts="4096", samples=100),
                  "cpu": BenchDefaults(tp=8, batches="1", contexts="1024", samples=10)}


def bench_defaults(device: str) -> BenchDefaults:
    return BENCH_DEFAULTS["cuda" if str(device).startswith("cuda") else "cpu"]


@dataclass
class BenchOutcome:
    device: str                          # "cuda" or "cpu"
    ceilings: dict | None                # copy_gbps / matmul_tflops, when measured
    rows: list[dict] = field(default_factory=list)   # one per (workload, candidate)

    def to_json(self) -> dict:
        return {"ceilings": self.ceilings, "trials": self.rows}


def parse_candidates(texts: list[str]) -> list[Candidate]:
    """'family/backend/p<page>[/k=v]' strings -> candidates, each checked, duplicates dropped."""
    try:
        return list(dict.fromkeys(check_candidate(Candidate.parse(c)) for c in texts))
    except ValueError as e:
        raise InputError(str(e)) from None


def bench_workloads(model: str | None, heads: int | None, tp: int, batches: list[int],
                    contexts: list[int], q_len: int, ragged: str, seed: int = 0):
    """The workloads of a bench invocation (model preset or custom head count)."""
    if ragged not in RAGGED_KINDS:
        raise InputError(f"--ragged must be one of {', '.join(RAGGED_KINDS)}, got {ragged!r}")
    dims = custom_model(heads) if heads else model_preset(model or "deepseek-v3")
    return [workload_for(dims, 1 if heads else tp, b, c, q_len, ragged, seed)
            for b in batches for c in contexts]


def bench_device(device: str | None) -> str:
    """The device a bench measures on: the one asked for, else cuda when torch sees one."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda but torch sees no CUDA device")
    return dev


@dataclass
class BenchPlan:
    """What one bench invocation measures: candidates x workloads on a device, with how many
    samples over how many rounds, and the results DB it stores them in (None: not stored)."""

    candidates: list
    workloads: list
    device: str
    samples: int
    rounds: int
    db: Path | None


def plan_bench(texts: list[str], *, model: str, heads: int | None, tp: int | None,
               batches: str | None, contexts: str | None, q_len: int, lengths: str,
               samples: int | None, rounds: int, rounds_given: bool = False,
               device: str | None = None, db: Path | None = None, store: bool = True) -> BenchPlan:
    """A bench invocation's values checked and the device's defaults (bench_defaults) filling
    the gaps; `rounds` is cut to the samples unless given explicitly (then it is an error)."""
    from mla_tune.tune.sweep.buckets import default_db, parse_sizes     # the one size-list rule, sweep's
    cands = parse_candidates(texts)
    dev = bench_device(device)
    d = bench_defaults(dev)
    samples = samples if samples is not None else d.samples
    if samples < rounds and rounds_given:
        raise InputError(f"--samples {samples} cannot be split over --rounds {rounds}")
    try:
        batch_list = parse_sizes(batches if batches is not None else d.batches, "batch")
        context_list = parse_sizes(contexts if contexts is not None else d.contexts, "context")
    except ValueError as e:     # parse_sizes raises plain ValueErrors
        raise InputError(f"--batches/--contexts: {e}") from None
    check_kv_tokens(max(batch_list), max(context_list))
    workloads = bench_workloads(model, heads, tp if tp is not None else d.tp, batch_list,
                                context_list, q_len, lengths)
    store_db = None if not store else (db if db is not None else default_db(dev))
    if store_db is not None:
        output_file(store_db, "--db", own=is_results_db)
    return BenchPlan(cands, workloads, dev, samples, min(rounds, samples), store_db)


def gpu_settings(settings: MeasureSettings, ceilings: bool) -> dict | None:
    """On CUDA: the KV pool larger than L2, and (if asked) the copy/matmul ceilings for % of floor."""
    settings.min_pool_bytes = default_pool_bytes(settings.device)
    if not ceilings:
        return None
    return {k: v for k, v in measure_ceilings(settings.device).items()
            if k in ("copy_gbps", "matmul_tflops")}


def run_bench(candidates, workloads, settings, rounds: int, db: str | None, ceilings: dict | None,
              command: str = "", on_progress=None, on_workload=None) -> BenchOutcome:
    """Measure `candidates` on each workload (interleaved), store them, one row per trial.
    `on_workload(done, total, workload)` is called before each workload (and with done == total
    at the end), `on_progress(candidate, ok)` as each candidate is prepared."""
    families = {}
    for c in candidates:
        if c.family not in families:
            try:
                families[c.family] = get_family(c.family, settings.profile)
            except KeyError as e:
                raise InputError(str(e).strip("'\"")) from None
    avail = {f: b.available(settings.device) for f, b in families.items()}
    store = ResultsStore(db) if db else None
    env = capture_environment(GPU_RUN_KIND if settings.device.startswith("cuda") else CPU_RUN_KIND,
                              command, settings.profile)
    env.update(ceilings or {})
    run_id = store.add_run(env) if store else None
    out = BenchOutcome(settings.device, ceilings)
    try:
        for i, w in enumerate(workloads):
            if on_workload is not None:
                on_workload(i, len(workloads), w)
            entries = [(families[c.family], c) for c in candidates if avail[c.family].ok]
            results = measure_interleaved(entries, w, settings, rounds,
                                          on_prepared=on_progress) if entries else []
            by_key = {r.candidate.key: r for r in results}
            wid = store.workload_id(w, workload_bytes(w), workload_flops(w)) if store else None
            for c in candidates:
                r = by_key.get(c.key) or TrialResult(c, "invalid", invalid_reason="unsupported",
                                                     message=avail[c.family].reason)
                if store:
                    store.add_trial(run_id, wid, c, r.status, r.samples, r.invalid_reason,
                                    r.message, r.compile_s, r.max_rel_error, sweep="bench")
                out.rows.append(_row(w, c, r, ceilings))
        if on_workload is not None:
            on_workload(len(workloads), len(workloads), None)
    finally:
        if store:
            store.close()
    return out


def _row(w, c: Candidate, r: TrialResult, ceilings: dict | None) -> dict:
    st = stats_of(r.samples.get(KERNEL_METRIC, []))
    pst = stats_of(r.samples.get(PLAN_METRIC, []))
    row = {"workload": w.label(), "candidate": c.key, "status": r.status,
           "invalid_reason": r.invalid_reason, "message": r.message,
           "median_us": st.median if st else None, "spread": st.spread if st else None,
           "min_us": st.minimum if st else None, "n": st.n if st else 0,
           "plan_us": pst.median if pst else None, "compile_s": r.compile_s,
           "max_rel_error": r.max_rel_error,
           "method": getattr(r.samples, "method", None)}
    if st and ceilings:
        row["pct_floor"] = pct_of_floor(st.median, w, ceilings.get("copy_gbps"),
                                        ceilings.get("matmul_tflops"))
    if st:
        row["gbps"], row["tflops"] = achieved(st.median, w)
    return row
