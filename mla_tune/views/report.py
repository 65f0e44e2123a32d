"""What was measured, for people: report views over a ResultsStore.

Per device: the runs; per workload the candidates side by side (median, spread, % of the roofline
floor, speedup over the family default, invalid ones with their reasons); per bucket the winner;
per model entry the global choice (page size, attention-backend order) and why. Winners and the
global choice come from `mla_tune.tune.choose` (the same rules `mla-tune emit` writes into the tuned
config); this module only arranges them. Works on any results.db, with no GPU.

`build_report(store, TrialFilter(...))` returns a `Report` (`Report.to_json` is its JSON);
mla_tune.views.report_format turns it into tables, the summary, CSV and markdown.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.tune import choose as choosing
from mla_tune.problem.workload import WorkloadMix
from mla_tune.views import prefill_view
from mla_tune.problem.roofline import floor_of, pct_of_floor
from mla_tune.problem.defaults import DEFAULT_PAGE_SIZE, PLAN_METRIC
from mla_tune.store.records import StoredWorkload, TrialRecord
from mla_tune.store.selection import CPU_RUN_KIND, SelectionError, TrialFilter, device_key, select_trials
from mla_tune.tune.verdict import Verdict

CPU_LABEL = "CPU torch reference: timings of the correctness oracle, not of a GPU kernel"
# What a CPU run is for, said wherever its numbers are shown: they are no verdict.
CPU_CAVEAT = ("not a verdict: the CPU torch reference checks that the pipeline runs end to end "
              "(measure, gate, store, choose); its timings are not kernel speeds and swing by "
              "orders of magnitude between runs, so they choose nothing. A GPU run gives the "
              "verdict (`mla-tune report --db results.db` shows the shipped H200 measurements).")


class ReportError(ValueError):
    """Nothing to report (or plot) for this selection; the message says why."""


def db_to_read(named=None, device: str | None = None):
    """The results DB a read command opens: the one named, else this machine's default
    (`default_db`); a default that does not exist while the shipped GPU DB does is a ReportError
    that points at it (a fresh CPU checkout has results.db but no results-cpu.db)."""
    from mla_tune.tune.sweep.buckets import GPU_DB, default_db    # lazy: the sweep's module imports torch
    if named is not None:
        return Path(named)
    path = default_db(device)
    if not path.exists() and path != GPU_DB and GPU_DB.exists():
        raise ReportError(f"no results DB at {path}, where `mla-tune sweep` writes on a machine "
                          f"without CUDA (run it first); the shipped GPU measurements are in "
                          f"{GPU_DB}: add --db {GPU_DB}")
    return path


# ---------------------------------------------------------------- the views

@dataclass
class CandidateLine:
    """One candidate's latest trial on one workload, with what people compare it by."""

    trial_id: int
    run_id: int
    candidate: str
    family: str
    backend: str
    page_size: int
    params: dict
    status: str
    invalid_reason: str | None
    message: str
    is_default: bool
    n: int
    median_us: float | None
    spread: float | None              # interquartile range / median
    min_us: float | None
    plan_median_us: float | None
    compile_s: float | None
    max_rel_error: float | None
    pct_roofline: float | None        # 100 * roofline floor / median
    default_candidate: str | None     # the family's default on this workload
    speedup_vs_default: float | None  # default median / this median
    chosen: bool = False              # the family's choice in this bucket at the global page size
    winner: bool = False              # the bucket's choice (best family's chosen candidate)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.median_us is not None

    @property
    def verdict(self) -> str:
        """winner (the bucket's choice), chosen (its family's choice), default: comma-joined."""
        tags = ["winner" if self.winner else "chosen" if self.chosen else "",
                "default" if self.is_default else ""]
        return ", ".join(t for t in tags if t)

    def status_text(self) -> str:
        if self.status == "ok":
            return "ok"
        first = (self.message or "").strip().splitlines()
        return f"{self.invalid_reason}: {first[0]}" if first else str(self.invalid_reason)


@dataclass(frozen=True)
class WorkloadView(StoredWorkload):
    """A stored workload as the report shows it: its roofline floor and its candidate lines."""

    floor_us: float | None = None     # at the run's ceilings (None without them)
    bound: str | None = None          # "memory" or "compute"
    lines: list = field(default_factory=list)

    @property
    def workload_id(self) -> int:
        return self.id

    @property
    def label(self) -> str:
        q = f" q{self.q_len}" if self.q_len != 1 else ""
        r = f" {self.ragged}" if self.ragged != "uniform" else ""
        return f"B{self.batch_size} L{self.context_len}{q}{r}"

    def to_json(self) -> dict:
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("id", "problem", "lines")}
        return {"workload_id": self.id, **shown, "label": self.label,
                "candidates": [_line_json(c) for c in self.lines]}


@dataclass
class DeviceReport:
    device_name: str
    kind: str                         # "gpu" or "cpu-reference"
    runs: list                        # run rows (dicts) whose trials are shown
    workloads: list                   # WorkloadView
    choice: choosing.Choice
    superseded: int = 0               # older trials of a re-measured candidate, not shown

    @property
    def is_reference(self) -> bool:
        return self.kind == CPU_RUN_KIND or device_key(self.device_name) == "cpu"

    def entry_of(self, wv: WorkloadView) -> choosing.ModelChoice | None:
        return next((m for m in self.choice.models if entry_key(m) == wv.entry_key), None)

    def views_of(self, m: choosing.ModelChoice) -> list:
        """The workloads of one model entry, in report order."""
        return [w for w in self.workloads if w.entry_key == entry_key(m)]


def entry_key(m: choosing.ModelChoice) -> tuple:
    """What makes a model entry (WorkloadView.entry_key's order)."""
    return (m.model, m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.q_dtype, m.kv_dtype, m.ragged)


@dataclass
class Report:
    db: str
    filter: TrialFilter
    devices: list                     # DeviceReport, GPU devices first
    mix: dict | None = None           # (batch, context) -> weight, None = uniform
    prefill: list = field(default_factory=list)   # prefill_view.PrefillLine
    prefill_records: list = field(default_factory=list)   # for the CSV

    def lines(self):
        """(device report, workload view, candidate line) for every line, in report order."""
        for d in self.devices:
            for w in d.workloads:
                for c in w.lines:
                    yield d, w, c

    def to_json(self) -> dict:
        return {
            "db": self.db,
            "filter": dataclasses.asdict(self.filter),
            "mix": None if self.mix is None else [
                {"batch_size": b, "context_len": c, "weight": x} for (b, c), x in sorted(self.mix.items())],
            "rules": _rules(self.devices[0].choice) if self.devices else None,
            "devices": [_device_json(d) for d in self.devices],
            "prefill": [ln.to_json() for ln in self.prefill],
        }


def build_report(store, flt: TrialFilter = TrialFilter(), mix: WorkloadMix | None = None,
                 **choose_kw) -> Report:
    """The report of the trials `flt` selects; winners by `mla_tune.tune.choose` under `mix`."""
    prefill = prefill_view.build_prefill(store, flt, **choose_kw)
    try:
        records = select_trials(store, flt)
    except SelectionError:
        if not prefill:         # a DB of `mla-tune prefill-sweep` alone: its prefill section
            raise
        return Report(str(store.path), flt, [], None, prefill, prefill_view.prefill_records(store, flt))
    if mix is not None and mix.weights:
        mix.check_covers({r.stored.bucket[:2] for r in records}, "the selected trials")
    latest = choosing.latest_trials(records)
    runs = {r["id"]: r for r in store.runs()}
    by_device: dict = {}
    for r in latest:
        by_device.setdefault(r.device_name, []).append(r)
    n_all = {}
    for r in records:
        n_all[r.device_name] = n_all.get(r.device_name, 0) + 1
    devices = []
    for name, drows in by_device.items():
        choice = choosing.choose(drows, mix, device_name=name, **choose_kw)
        run_ids = sorted({r.run_id for r in drows})
        kinds = {runs[i].get("kind") or "" for i in run_ids}
        kind = "gpu" if "gpu" in kinds else CPU_RUN_KIND if CPU_RUN_KIND in kinds else choice.kind
        dev = DeviceReport(name, kind, [runs[i] for i in run_ids], [], choice,
                           n_all[name] - len(drows))
        dev.workloads = _workload_views(drows, dev)
        devices.append(dev)
    devices.sort(key=lambda d: (d.is_reference, d.device_name))
    return Report(str(store.path), flt, devices, dict(mix.weights) if mix and mix.weights else None,
                  prefill, prefill_view.prefill_records(store, flt))


def _workload_views(records: list[TrialRecord], dev: DeviceReport) -> list[WorkloadView]:
    groups: dict = {}
    for r in records:
        groups.setdefault(r.stored.id, []).append(r)
    views = []
    for wid, wrecs in groups.items():
        sw = wrecs[0].stored
        wl = sw.problem
        ceil = next(((r.copy_gbps, r.matmul_tflops) for r in wrecs
                     if r.copy_gbps and r.matmul_tflops), (None, None))
        floor = floor_of(wl, *ceil) if wl is not None and ceil[0] else None
        wv = WorkloadView(**{f.name: getattr(sw, f.name) for f in dataclasses.fields(sw)},
                          floor_us=floor.us if floor else None,
                          bound=floor.bound if floor else None)
        defaults = _family_defaults(wrecs, wl)
        for r in wrecs:
            st, pst = r.stats(), r.stats(PLAN_METRIC)
            median = st.median if st and r.ok else None
            d = _default_for(defaults, r)
            d_stats = d.stats() if d is not None and d.ok else None
            d_median = d_stats.median if d_stats else None
            c = r.candidate
            wv.lines.append(CandidateLine(
                r.id, r.run_id, r.key, c.family, c.backend, c.page_size, dict(c.params), r.status,
                r.invalid_reason, r.message, bool(r.is_default) or (d is not None and d.id == r.id),
                st.n if st else 0, median, st.spread if st and median is not None else None,
                st.minimum if st and median is not None else None, pst.median if pst else None,
                r.compile_s, r.max_rel_error,
                pct_of_floor(median, wl, r.copy_gbps, r.matmul_tflops)
                if wl is not None and median else None,
                d.key if d is not None else None,
                d_median / median if d_median and median else None))
        _mark_choices(wv, dev)
        wv.lines.sort(key=lambda c: (not c.ok, c.median_us if c.ok else 0.0, c.family, c.candidate))
        views.append(wv)
    views.sort(key=lambda w: (w.model, -w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype,
                              w.kv_dtype, w.ragged, w.q_len, w.batch_size, w.context_len))
    return views


def _family_defaults(records: list[TrialRecord], wl) -> dict:
    """family -> the trials that are its untuned default on this workload (one per page size).

    Trials carry is_default from the sweep; for trials without the mark (older DBs) the family
    names its default, as `mla_tune.tune.choose` does.
    """
    out: dict = {}
    for r in records:
        if r.is_default:
            out.setdefault(r.candidate.family, []).append(r)
    for fam in {r.candidate.family for r in records} - set(out):
        if any(r.is_default is not None for r in records if r.candidate.family == fam) or wl is None:
            continue   # the sweep marked this family's trials and none is the default
        keys = {choosing.family_default(fam, wl, p) for p in {r.candidate.page_size for r in records}}
        found = [r for r in records if r.candidate.family == fam and r.key in keys]
        if found:
            out[fam] = found
    return out


def _default_for(defaults: dict, record: TrialRecord) -> TrialRecord | None:
    """The default a candidate is compared with: its family's at the same page size, else the
    family's default at the default page size, else any."""
    cands = defaults.get(record.candidate.family) or []
    for want in (record.candidate.page_size, DEFAULT_PAGE_SIZE):
        for d in cands:
            if d.candidate.page_size == want:
                return d
    return cands[0] if cands else None


def _mark_choices(wv: WorkloadView, dev: DeviceReport) -> None:
    entry = dev.entry_of(wv)
    bucket = entry.bucket(wv.batch_size, wv.context_len, wv.q_len) if entry else None
    if bucket is None:
        return
    chosen = {f: v.chosen.trial_id for f, v in bucket.families.items() if v.chosen is not None}
    for c in wv.lines:
        if chosen.get(c.family) == c.trial_id:
            c.chosen = True
            c.winner = c.family == bucket.best_family


# ---------------------------------------------------------------- JSON

def _rules(choice: choosing.Choice) -> dict:
    return {"p_threshold": choice.p_threshold, "min_ratio": choice.min_ratio,
            "default_page_size": choice.default_page_size, "metric": choice.metric,
            "test": "one-sided Mann-Whitney U on raw samples, plus a minimum median ratio"}


def _verdict_json(v: Verdict) -> dict:
    return {"family": v.family, "page_size": v.page_size,
            "chosen": v.chosen.key if v.chosen else None, "time_us": v.time_us,
            "default": v.default.key if v.default else None, "default_time_us": v.default_time_us,
            "best": v.best.key if v.best else None, "gain": v.gain, "significant": v.significant,
            "p_value": v.p_value, "ratio": v.ratio, "reason": v.reason,
            "n_valid": v.n_valid, "n_invalid": v.n_invalid}


def _entry_json(m: choosing.ModelChoice) -> dict:
    return {
        "model": m.model, "tp_size": m.tp_size, "num_heads": m.num_heads,
        "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
        "q_dtype": m.q_dtype, "kv_dtype": m.kv_dtype, "ragged": m.ragged,
        "global": {"page_size": m.page_size, "page_reason": m.page_reason,
                   "family_order": list(m.family_order), "backend_order": list(m.backend_order),
                   "order_reason": m.order_reason,
                   "totals": [dataclasses.asdict(t) for t in m.totals]},
        "buckets": [{"batch_size": b.batch_size, "context_len": b.context_len, "q_len": b.q_len,
                     "weight": b.weight, "best_family": b.best_family, "time_us": b.time_us,
                     "families": {f: _verdict_json(v) for f, v in b.families.items()}}
                    for b in m.buckets],
    }


def _line_json(c: CandidateLine) -> dict:
    d = dataclasses.asdict(c)
    d["verdict"] = c.verdict
    return d


def _device_json(d: DeviceReport) -> dict:
    return {
        "device_name": d.device_name, "kind": d.kind,
        "note": CPU_LABEL if d.is_reference else None,
        "runs": d.runs, "superseded_trials": d.superseded, "notes": list(d.choice.notes),
        "workloads": [w.to_json() for w in d.workloads],
        "models": [_entry_json(m) for m in d.choice.models],
    }
