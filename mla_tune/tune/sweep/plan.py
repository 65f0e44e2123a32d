"""Planning a sweep: the families that run here, each bucket's search space (what was refused on
this device before left out), its search mode and trial budget, and each bucket's share of a
time budget. Nothing runs.

    plan_sweep(config, store)        -> (SweepPlan, {"backends", "refused"})
    plan_bucket(bucket, space, cfg)  -> PlannedBucket     (the live sweep, its re-planning, replay)
    bucket_weight(p), budget_share(seconds_left, weights)
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mla_tune.families import family_names, get_family
from mla_tune.families.base import Candidate, CandidateInvalid
from mla_tune.problem.roofline import workload_bytes
from mla_tune.problem.workload import ProblemError, Workload
from mla_tune.store.selection import profile_clause
from mla_tune.tune.search_space import SearchSpace
from mla_tune.tune.study_storage import is_rdb_url, redact
from mla_tune.tune.sweep.buckets import Bucket, default_db, detect_device, journal_path_for
from mla_tune.tune.sweep.config import SweepConfig, SweepInputError, default_families, sweep_profile
from vllm_metax.core import device as core_device
from vllm_metax.core.choices import KNOBS
from vllm_metax.core.profile import target_profile

CPU_REFERENCE_NOTE = (
    "No CUDA device here (torch.cuda.is_available() is False), so this sweep measures the CPU "
    "torch reference: the correctness oracle run with torch on the CPU, not a serving kernel. Its "
    "numbers exercise the pipeline (store, search, winners, config); they say nothing about "
    "FlashInfer or Triton speed. Run on a GPU for real measurements.")


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
    """Where a sweep runs and what it will search: the device, its families, every planned bucket."""

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
    profile: str = ""              # the target profile the families are limited to

    @property
    def planned_trials(self) -> int:
        return sum(p.budget for p in self.buckets)

    def estimate_note(self) -> str:
        """One line: buckets, candidates, modes."""
        sizes = [len(p.space) for p in self.buckets]
        modes = sorted({p.mode for p in self.buckets})
        dropped = sum(len(p.space.dropped) for p in self.buckets)
        lo, hi = min(sizes, default=0), max(sizes, default=0)
        return (f"{len(self.buckets)} buckets, {lo if lo == hi else f'{lo}-{hi}'} candidates each, "
                f"search {'/'.join(modes) or '-'}, up to {self.planned_trials} trials"
                + (f" ({dropped} dropped by constraints)" if dropped else ""))


def resolve_families(requested: Sequence[str] | None, device: str,
                     profile=None) -> tuple[dict, dict]:
    """(available family -> backend, skipped family -> reason), each family limited to
    `profile`'s target (None: the active profile). Unknown names raise SweepInputError; `None`
    picks by device (the profile's families on a GPU, CPU_FAMILIES without); a named family the
    profile's target does not run is skipped, saying so."""
    prof = target_profile(profile)
    names = list(requested) if requested else list(default_families(device, prof))
    unknown = [n for n in names if n not in family_names()]
    if unknown:
        raise SweepInputError(f"unknown kernel family {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(family_names())}")
    available, skipped = {}, {}
    for n in dict.fromkeys(names):
        if n in KNOBS and n not in prof.families:
            skipped[n] = f"the {prof.name} profile's target does not run {n} (--profile)"
            continue
        backend = get_family(n, prof.name)
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


def unsupported_key(c: Candidate, w: Workload) -> tuple:
    """What a refusal ("unsupported") depends on: the device, the kernel, the page size and the
    head geometry, not batch or context, so the same candidate is not tried again in later buckets."""
    return (c.family, c.backend, c.page_size, tuple(sorted(c.params.items())), w.num_heads,
            w.kv_lora_rank, w.qk_rope_head_dim, w.q_len, w.q_dtype, w.kv_dtype)


def space_for(bucket: Bucket, backends: dict, page_sizes: Sequence[int], refused: dict) -> SearchSpace:
    """The bucket's search space: what the families declare at these page sizes, their defaults
    always in it, less what `refused` (unsupported_key -> where and why) says was refused."""
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
        hit = refused.get(unsupported_key(c, w))
        return f"refused in {hit[0]}: {hit[1]}" if hit else None

    return SearchSpace.build(cands, defaults, [refused_before])


def study_name(config: SweepConfig, b: Bucket, space: SearchSpace | None = None) -> str:
    """The bucket's optuna study. With `space` (the bucket's declared candidates, before any
    refusal learnt on this machine), the shared study's name: a fingerprint of that space, so a
    sweep over other page sizes or families is another study, and the --remeasure tag."""
    w = b.workload
    name = f"{config.name} | {b.label} | {w.q_dtype}/{w.kv_dtype} | seed {w.seed}"
    if space is None:
        return name
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
    profile = sweep_profile(config)
    backends, skipped = families or resolve_families(config.families, device, profile)
    kind = "gpu" if device.startswith("cuda") else "cpu-reference"
    note = CPU_REFERENCE_NOTE if kind == "cpu-reference" and "reference" in backends else ""
    if device.startswith("cuda") and "reference" in backends:
        note = "Measuring the torch reference on the GPU: an oracle, not a serving kernel."
    refused = refusals(store, device, profile.name) if store is not None and not config.remeasure else {}
    planned = []
    for i, b in enumerate(config.buckets):
        planned.append(plan_bucket(b, space_for(b, backends, config.page_sizes, refused), config,
                                   index=i))
    db = Path(config.db) if config.db is not None else default_db(device)
    journal, storage = None, ""
    if config.storage:
        if is_rdb_url(config.storage):
            storage = redact(config.storage)
        else:
            journal = Path(config.storage)
    elif config.journal is not False:
        journal = Path(config.journal) if config.journal else journal_path_for(db)
    plan = SweepPlan(device, kind, list(backends), skipped, planned, note, db, journal,
                     storage=storage, db_uid=store.db_uid if journal is not None and store is not None else "",
                     profile=profile.name)
    return plan, {"backends": backends, "refused": refused}


def tag_remeasure(config: SweepConfig) -> None:
    """--remeasure measures everything again: in studies of its own, shared by this launch's
    workers (the tag is set once, by the first process that plans)."""
    if config.remeasure and not config.study_tag:
        config.study_tag = f"remeasure {time.strftime('%Y%m%dT%H%M%S')} {uuid.uuid4().hex[:6]}"


def device_name_of(device: str) -> str:
    """The name trials are stored under: the GPU's (vllm_metax.core.device), or "cpu"."""
    return core_device.detect_device().name if device.startswith("cuda") else "cpu"


def refusals(store, device: str, profile: str | None = None) -> dict:
    """unsupported_key -> (workload label, first line of the refusal) of every candidate this
    device refused in an earlier sweep of the store (under `profile`, where given: a refusal of
    one target's kernel says nothing of another's)."""
    out = {}
    name = device_name_of(device)
    where, args = "r.device_name = ? and t.status = 'invalid' and t.invalid_reason = 'unsupported'", [name]
    if profile:
        clause, more = profile_clause(profile)
        where, args = f"{where} and {clause}", args + more
    for r in store.trials(where, args):
        try:
            w = Workload.from_row(r)
        except ProblemError:     # a row another version wrote: its refusal is not learnt
            continue
        c = Candidate(r["family"], r["backend"], r["page_size"], r["params"])
        out.setdefault(unsupported_key(c, w), (w.label(), (r["message"] or "").splitlines()[0][:200]))
    return out


# A trial's cost is a fixed part (prepare, correctness gate, plan timing) plus the timed launches,
# which scale with the bytes the kernel moves. H200 default sweep, 2026-12-02: ~45 ms per trial
# at B1 L1K, ~170 ms at B128 L32K (4.8 GB of KV) with 16 heads, more with 128 (Triton's 2.6 ms
# kernels): the two parts are about equal near 1 GB. Only ratios matter.
TRIAL_FIXED_BYTES = 1e9


def bucket_weight(p: PlannedBucket) -> float:
    """Expected relative cost of searching bucket p: trials x (fixed + bytes-proportional part)."""
    trials = max(1, min(p.budget or len(p.space), len(p.space)))
    return trials * (1.0 + workload_bytes(p.bucket.workload) / TRIAL_FIXED_BYTES)


def budget_share(seconds_left: float, weights: Sequence[float]) -> float:
    """The next bucket's seconds: its weight's fraction of the time left over the buckets left
    (weights[0] is the next bucket's). Buckets that finish early leave their rest to the others."""
    total = sum(weights)
    return seconds_left * (weights[0] / total if total > 0 else 1.0 / max(1, len(weights)))

