"""Winners and the global choice, computed from stored trials (`ResultsStore.records()`).

Rules (asv's; docs/tuning.md, "what counts as a difference": a few percent is noise without a test):

* Per bucket, family and page size, the fastest valid candidate displaces the family's untuned
  default only if it is faster beyond noise (mla_tune.tune.verdict: a one-sided Mann-Whitney U
  test on the raw kernel samples, p < `p_threshold`, AND a median ratio >= `min_ratio`).
  Otherwise the default stays and the verdict's reason starts with "no significant difference".
* The KV page size is fixed for a server's lifetime, so it is chosen once per model entry: the
  (family, page size) pair with the smallest weighted total over the buckets (weights from the
  WorkloadMix, uniform by default) wins; its page size stands unless the default page size
  (`default_page_size`, 64) is within `min_ratio` of it, in which case the default page stays.
* The attention-backend order (FLASHINFER_MLA, TRITON_MLA, FLASHMLA: at page 64 only) ranks the
  families by their weighted total at the chosen page size; per bucket, each family keeps its own chosen plan parameters
  (FlashInfer backend, Triton num_kv_splits) and `best_family` names the fastest of them.

Everything is plain frozen dataclasses: `choose(rows, mix)` returns a `Choice`; its `models` are
`ModelChoice`s (one per device x model dims x dtypes x length distribution: one tuned-config
model entry), each with `BucketChoice`s whose `families` map family -> `Verdict`:

    with ResultsStore("results.db", create=False) as store:
        choice = choose(store.records(), WorkloadMix.from_file("mix.csv"), device_name="NVIDIA H200")
    for m in choice.models:
        m.page_size, m.backend_order        # global: KV block size; attention backends, best first
        for b in m.buckets:                 # b.batch_size, b.context_len, b.q_len, b.best_family
            v = b.families["flashinfer"]    # v.chosen.plan_params, v.time_us, v.default_time_us,
                                            # v.significant, v.reason

The latest trial per (device, workload, candidate) counts. A bucket's family default is the trial
stored with is_default = 1 (the sweep marks it); trials without the mark fall back to asking the
family (`default_of`). Mix rows snap to the nearest measured bucket (`bucket_weights`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterable

from mla_tune.families import get_family
from mla_tune.problem.defaults import DEFAULT_PAGE_SIZE, KERNEL_METRIC
from mla_tune.problem.units import us_text
from mla_tune.problem.workload import ProblemError, WorkloadMix, model_preset
from mla_tune.store.records import TrialRecord, as_records
from mla_tune.tune.verdict import MIN_RATIO, P_THRESHOLD, Measured, decide, min_p_value
from vllm_metax.core.choices import SPECS
from vllm_metax.core.decisions import bucket_context
from vllm_metax.core.tuned_config.schema import nearest

METRIC = KERNEL_METRIC            # what winners are chosen by
# sweep family -> vLLM's attention backend (`KernelSpec.attention_backend`; the plugin serves
# all three). split and fa3_mla are not backends of their own: FLASHINFER_MLA's decode runs them
# per bucket (decisions.side_kernel)
ATTENTION_BACKEND = {f: s.attention_backend for f, s in SPECS.items() if s.attention_backend}


def backend_order(family_order, page_size: int | None) -> tuple:
    """The attention backends of `family_order` that run at `page_size` (the family's page rule,
    `KernelSpec.page`: FLASHMLA only at 64), best first."""
    return tuple(ATTENTION_BACKEND[f] for f in family_order if f in ATTENTION_BACKEND
                 and (SPECS[f].page.allows(page_size) if page_size is not None else SPECS[f].page.only is None))


@dataclass(frozen=True)
class BucketChoice:
    """One (batch, context, q_len) bucket: per family the verdict at the chosen page size."""

    batch_size: int
    context_len: int
    q_len: int
    weight: float
    families: dict                  # family -> Verdict at the model entry's page size
    best_family: str | None         # fastest chosen candidate among `families`
    per_page: dict = field(default_factory=dict, repr=False)   # page -> family -> Verdict
    # the context the plugin finds this bucket by: `vllm_metax.core.decisions.bucket_context` of the
    # measured per-request lengths (context_len itself for uniform lengths)
    lookup_context: int | None = None

    @property
    def time_us(self) -> float | None:
        v = self.families.get(self.best_family) if self.best_family else None
        return v.time_us if v else None


@dataclass(frozen=True)
class FamilyTotal:
    """Weighted total of a family's chosen times at one page size over the weighted buckets."""

    family: str
    page_size: int
    total_us: float
    covered: int                    # weighted buckets with a valid chosen candidate
    of: int                         # weighted buckets in the model entry

    @property
    def complete(self) -> bool:
        return self.covered == self.of


@dataclass(frozen=True)
class ModelChoice:
    """Everything chosen for one model entry (device, heads per rank, dims, dtypes, lengths).

    `page_size` is the global KV block size; `family_order` ranks kernel families best first,
    `backend_order` maps them to vLLM attention backends (families without one, such as the CPU
    reference, are left out); `totals` holds every (family, page) weighted total considered.
    """

    device_name: str
    model: str
    tp_size: int | None
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    q_dtype: str
    kv_dtype: str
    ragged: str
    page_size: int | None
    page_reason: str
    family_order: tuple
    backend_order: tuple
    order_reason: str
    totals: tuple                   # FamilyTotal, all (family, page) pairs
    buckets: tuple                  # BucketChoice, sorted by (q_len, batch, context)

    @property
    def best_family(self) -> str | None:
        return self.family_order[0] if self.family_order else None

    def total(self, family: str, page_size: int | None = None) -> FamilyTotal | None:
        page = self.page_size if page_size is None else page_size
        return next((t for t in self.totals if t.family == family and t.page_size == page), None)

    def bucket(self, batch_size: int, context_len: int, q_len: int = 1) -> BucketChoice | None:
        return next((b for b in self.buckets if (b.batch_size, b.context_len, b.q_len)
                     == (batch_size, context_len, q_len)), None)


@dataclass(frozen=True)
class Choice:
    """The choice for one device: one ModelChoice per model entry, with the rules applied."""

    device_name: str
    kind: str                       # "gpu" or "cpu-reference" (the run kind of the trials)
    models: tuple
    p_threshold: float = P_THRESHOLD
    min_ratio: float = MIN_RATIO
    default_page_size: int = DEFAULT_PAGE_SIZE
    metric: str = METRIC
    n_trials: int = 0
    notes: tuple = ()


# ---------------------------------------------------------------- trials -> measured candidates

def _identity(r) -> tuple:
    """(device, workload id, candidate key) and the trial id, of a TrialRecord or a trials() row."""
    if isinstance(r, TrialRecord):
        return (r.device_name, r.stored.id, r.key), r.id
    return (r.get("device_name"), r["workload_id"], r["candidate"]), r["id"]


def latest_trials(trials: Iterable) -> list:
    """The latest trial per (device, workload, candidate): a re-measurement replaces the old one.
    Takes TrialRecords (or `ResultsStore.trials()` rows) and returns the same kind."""
    latest: dict = {}
    for r in trials:
        k, tid = _identity(r)
        if k not in latest or tid > latest[k][0]:
            latest[k] = (tid, r)
    return [r for _, r in sorted(latest.values(), key=lambda x: x[0])]


def measured_of(record: TrialRecord, metric: str = METRIC) -> Measured:
    """A TrialRecord reduced to what a verdict (`decide`) needs."""
    samples = tuple(record.values(metric))
    median = None
    if record.ok and samples:
        median = float(statistics.median(samples))
    c = record.candidate
    return Measured(record.key, c.family, c.backend, c.page_size, dict(c.params), record.status,
                    record.invalid_reason, median, samples, record.id, bool(record.is_default))


def family_default(family: str, workload, page_size: int) -> str | None:
    """The family's default candidate key as the family declares it (None if it cannot say)."""
    try:
        return get_family(family).default_candidate(workload, page_size).key
    except Exception:   # an unavailable or unknown family cannot name its default
        return None


def _lookup_context(records: list[TrialRecord]) -> int | None:
    """The plugin's lookup statistic over the lengths a bucket was measured with."""
    wl = records[0].workload if records else None
    return bucket_context(wl.seq_lens) if wl is not None else None


def tp_size_of(model: str, heads_per_rank: int) -> int | None:
    """The TP size at which `model` has this many heads per rank (None: no preset, or no such size)."""
    try:
        total = model_preset(model).num_heads
    except ProblemError:
        return None
    return total // heads_per_rank if heads_per_rank and total % heads_per_rank == 0 else None


def bucket_weights(mix: WorkloadMix | None, keys: Iterable[tuple[int, int, int]]) -> dict:
    """(batch, context, q_len) -> weight. Uniform without a mix; otherwise every mix row adds its
    weight to the nearest bucket on a log2 scale (batch first, then context), as the plugin's
    lookup snaps (`schema.nearest`, the one rule): a (batch, context) row for every q_len of that
    (batch, context); a (batch, context, q_len) row (a recorded traffic) to the bucket of its
    q_len, snapped first as the lookup does (`ModelEntry.lookup`)."""
    keys = list(keys)
    if mix is None or not mix.weights:
        return {k: 1.0 for k in keys}
    out = {k: 0.0 for k in keys}
    if not keys:
        return out
    q_lens = sorted({k[2] for k in keys})
    for row, w in mix.weights.items():
        b, c = row[0], row[1]
        if len(row) > 2:
            q = row[2] if row[2] in q_lens else nearest(q_lens, row[2])
            at_q = [k for k in keys if k[2] == q]
        else:
            at_q = keys
        nb = nearest(sorted({k[0] for k in at_q}), b)
        nc = nearest(sorted({k[1] for k in at_q if k[0] == nb}), c)
        for k in at_q:
            if k[0] == nb and k[1] == nc:
                out[k] += w
    return out


# ---------------------------------------------------------------- the choice

DefaultOf = Callable[[str, object, int], "str | None"]   # (family, Workload, page) -> key


def choose(trials: Iterable, mix: WorkloadMix | None = None, *, device_name: str | None = None,
           p_threshold: float = P_THRESHOLD, min_ratio: float = MIN_RATIO,
           default_page_size: int = DEFAULT_PAGE_SIZE, metric: str = METRIC,
           default_of: DefaultOf | None = family_default) -> Choice:
    """Winners per bucket and the global choice for one device, from `ResultsStore.records()`
    (or the `ResultsStore.trials()` rows older callers hold).

    `trials` may hold several runs; the latest trial per (workload, candidate) counts. With trials
    of several devices, `device_name` picks one (ValueError if it is missing). A family's default
    in a bucket is the trial stored with is_default = 1; for trials without that mark (older DBs,
    hand-built fixtures) `default_of(family, workload, page_size)` names it (default: ask the
    family; pass None to treat such buckets as having no default).
    """
    rows = latest_trials(as_records(trials))
    devices = sorted({r.device_name for r in rows})
    if device_name is None:
        if len(devices) > 1:
            raise ValueError(f"trials of several devices ({', '.join(map(str, devices))}); name one")
        device_name = devices[0] if devices else ""
    rows = [r for r in rows if r.device_name == device_name]
    kinds = sorted({r.run_kind for r in rows})
    notes: list[str] = []
    if mix is not None and mix.weights and rows and not mix.snap:
        measured = {r.stored.bucket[:2] for r in rows}
        missing = sorted(k for k, x in mix.weights.items() if x > 0 and k not in measured)
        if missing:
            notes.append(f"{len(missing)} weighted bucket(s) of the mix not measured on "
                         f"{device_name or 'this device'} count for nothing: "
                         + ", ".join(f"B{b} L{c}" for b, c in missing[:5]))
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.stored.entry_key, []).append(r)
    models = []
    for g, grows in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2:])):
        models.append(_choose_model(device_name, g, grows, mix, p_threshold, min_ratio,
                                    default_page_size, metric, default_of, notes))
    return Choice(device_name, kinds[-1] if kinds else "", tuple(models), p_threshold, min_ratio,
                  default_page_size, metric, len(rows), tuple(dict.fromkeys(notes)))


def choose_from_store(store, mix: WorkloadMix | None = None, where: str = "1=1", args=(), **kw) -> Choice:
    """`choose` over `store.records(where, args)` (a ResultsStore)."""
    return choose(store.records(where, args), mix, **kw)


def _choose_model(device_name, g, rows, mix, p_threshold, min_ratio, default_page_size, metric,
                  default_of, notes) -> ModelChoice:
    model, heads, lora_rank, rope, q_dt, kv_dt, ragged = g
    per_bucket: dict = {}
    for r in rows:
        per_bucket.setdefault(r.stored.bucket, []).append(r)
    weights = bucket_weights(mix if mix is None or mix.applies(heads, lora_rank) else None, per_bucket)
    families = sorted({r.candidate.family for r in rows})
    pages = sorted({r.candidate.page_size for r in rows})
    verdicts = _verdicts(per_bucket, families, pages, p_threshold, min_ratio, metric, default_of,
                         notes)
    totals = _family_totals(verdicts, weights, list(per_bucket), families, pages)
    page, page_reason = _global_page(totals, default_page_size, min_ratio)
    at_page = sorted((t for t in totals if t.page_size == page), key=_rank)
    ranked = [t.family for t in at_page]
    rest = sorted((f for f in families if f not in ranked),
                  key=lambda f: min((_rank(t) for t in totals if t.family == f), default=(0, math.inf)))
    family_order = tuple(ranked + rest)
    order_reason = "; ".join(f"{t.family} {us_text(t.total_us)} ({t.covered}/{t.of})"
                             for t in at_page) or "no family measured"
    if page is not None:
        order_reason = f"weighted total at page {page}: {order_reason}"
    buckets = []
    for bk in sorted(per_bucket, key=lambda k: (k[2], k[0], k[1])):
        fams = {f: verdicts[(bk, f, page)] for f in families if (bk, f, page) in verdicts}
        timed = [(v.time_us, f) for f, v in fams.items() if v.time_us is not None]
        per_page: dict = {}
        for (k, f, p), v in verdicts.items():
            if k == bk:
                per_page.setdefault(p, {})[f] = v
        buckets.append(BucketChoice(bk[0], bk[1], bk[2], weights.get(bk, 0.0), fams,
                                    min(timed)[1] if timed else None, per_page,
                                    _lookup_context(per_bucket[bk])))
    return ModelChoice(device_name, model, tp_size_of(model, heads), heads, lora_rank, rope, q_dt, kv_dt,
                       ragged, page, page_reason, family_order,
                       backend_order(family_order, page),
                       order_reason, tuple(totals), tuple(buckets))


def _verdicts(per_bucket: dict, families: list, pages: list, p_threshold, min_ratio, metric,
              default_of, notes: list) -> dict:
    """(bucket, family, page) -> Verdict of the family's candidates there against its default;
    a note where the samples are too few for the test to ever reach p_threshold."""
    verdicts: dict = {}
    for bk, brows in per_bucket.items():
        for fam in families:
            for page in pages:
                cand_rows = [r for r in brows if r.candidate.family == fam and r.candidate.page_size == page]
                if not cand_rows:
                    continue
                measured = [measured_of(r, metric) for r in cand_rows]
                default_key = next((m.key for m in measured if m.is_default), None)
                if default_key is None and default_of is not None:
                    wl = cand_rows[0].workload
                    default_key = default_of(fam, wl, page) if wl is not None else None
                v = decide(measured, default_key, fam, page, p_threshold, min_ratio)
                if v.best and v.default and v.default.ok and v.best.key != v.default.key and \
                        min_p_value(len(v.default.samples), len(v.best.samples)) >= p_threshold:
                    notes.append(f"{len(v.default.samples)} samples per candidate cannot reach "
                                 f"p < {p_threshold:g}: measure more samples")
                verdicts[(bk, fam, page)] = v
    return verdicts


def _family_totals(verdicts: dict, weights: dict, buckets: list, families: list, pages: list) -> list:
    """Per family and page size, the mix-weighted total of its chosen times over the weighted
    buckets where it has a valid candidate."""
    weighted = [bk for bk in buckets if weights.get(bk, 0) > 0]
    totals = []
    for fam in families:
        for page in pages:
            covered, total = 0, 0.0
            for bk in weighted:
                v = verdicts.get((bk, fam, page))
                if v is not None and v.time_us is not None:
                    covered += 1
                    total += weights[bk] * v.time_us
            if covered:
                totals.append(FamilyTotal(fam, page, total, covered, len(weighted)))
    return totals


def _rank(t: FamilyTotal):
    return (-t.covered, t.total_us, t.family, t.page_size)


def _global_page(totals: list, default_page_size: int, min_ratio: float) -> tuple:
    """(page size, why): the best family's page over the mix, the default page kept unless
    another is at least min_ratio faster over the same buckets."""
    if not totals:
        return None, "no valid candidate in any weighted bucket"
    best = min(totals, key=_rank)
    page = best.page_size
    page_reason = (f"page {page}: smallest weighted total ({best.family}, "
                   f"{us_text(best.total_us)} over {best.covered}/{best.of} buckets)")
    at_default = next((t for t in totals if t.family == best.family
                       and t.page_size == default_page_size), None)
    if page == default_page_size:
        page_reason = f"page {page} (the default) has the smallest weighted total ({best.family})"
    elif at_default is not None and at_default.covered == best.covered:
        gain = at_default.total_us / best.total_us
        if gain < min_ratio:
            page = default_page_size
            page_reason = (f"page {default_page_size} (the default) kept: page {best.page_size} "
                           f"is only {gain:.3f}x faster over the mix ({best.family}; needs "
                           f">= {min_ratio:g}x)")
        else:
            page_reason += f"; {gain:.2f}x faster than the default page {default_page_size}"
    if not best.complete:
        page_reason += f" (only {best.covered} of {best.of} buckets have a valid candidate)"
    return page, page_reason
