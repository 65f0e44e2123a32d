"""Tuning the MLA prefill backend: prefill buckets -> measured trials in results.db -> the tuned
config's prefill section (`mla-tune prefill-sweep`, then `mla-tune emit`).

    plan_prefill_buckets(...)        -> [PrefillWorkload]   new tokens and context chunks per TP
    run_prefill_sweep(config)        -> PrefillOutcome      measure, store every trial (resumable)
    choose_prefill(rows)             -> {dims: [PrefillVerdict]}    the decode sweep's rule
    prefill_buckets(verdicts)        -> [tuned_config.PrefillBucket]   (emit.with_prefill)

A bucket is what the plugin looks a prefill plan up by (`vllm_metax.core.decisions.prefill_statistic`:
plan kind, total query tokens, mean KV tokens per request). The default buckets are the shapes
bench/experiments/prefill_choice.py measured on the H200 (where the backend turned out a real choice): new
tokens of 256-8K in one request and in four, and context chunks of 256 or 2K queries against
1K-64K KV tokens, at the model's heads per rank for each TP size. Each candidate is measured
through the plugin's own op (`mla_tune.families.flashinfer_prefill`), gated against the torch
reference. Per bucket the plugin's untuned default (fa3 on Hopper, fa2 elsewhere) is replaced only
when another backend is faster by a one-sided Mann-Whitney p < 0.002 and >= 1.05x
(`mla_tune.tune.verdict.decide`, the decode rule). The measuring runs in this process (FlashInfer's
production prefill kernels, fa2/fa3, are not the crash-prone candidates the decode sweep isolates);
every trial is committed as it finishes, so a rerun continues where a killed one stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from mla_tune.families.flashinfer_prefill import FlashInferPrefillFamily
from mla_tune.measure.environment import capture_environment
from mla_tune.measure.prefill_trial import measure_prefill
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.prefill import PrefillWorkload, prefill_workload
from mla_tune.problem.workload import ProblemError, model_preset
from mla_tune.store.results import ResultsStore
from mla_tune.store.selection import CPU_RUN_KIND, GPU_RUN_KIND
from mla_tune.tune import choose as choosing
from mla_tune.tune.verdict import MIN_RATIO, P_THRESHOLD, decide
from vllm_metax.core import device as core_device, tuned_config as tc
from vllm_metax.core.decisions import model_key, prefill_statistic

SWEEP_NAME = "prefill"
NEW_TOKENS = (256, 1024, 2048, 8192)       # query tokens of a step's new-token plan
NEW_REQUESTS = (1, 4)                      # ... as one request, and as four of equal length
CHUNK_QUERIES = (256, 2048)                # a context chunk's query tokens (one request)
CHUNK_KV = (1024, 4096, 16384, 65536)      # ... against this many cached KV tokens
TP_SIZES = (1, 8)                          # DeepSeek-V3: 128 and 16 heads per rank


class PrefillSweepError(ValueError):
    """A prefill sweep that cannot start (the message says why; nothing was written)."""


def plan_prefill_buckets(model: str = "deepseek-v3", tp_sizes: Sequence[int] = TP_SIZES,
                         new_tokens: Sequence[int] = NEW_TOKENS,
                         new_requests: Sequence[int] = NEW_REQUESTS,
                         chunk_queries: Sequence[int] = CHUNK_QUERIES,
                         chunk_kv: Sequence[int] = CHUNK_KV, q_dtype: str = "bfloat16") -> list:
    """Every prefill bucket: per TP size the new tokens (each total split over each request
    count that divides it) and the context chunks (queries x KV tokens, one request)."""
    dims = model_preset(model)
    out = []
    for tp in tp_sizes:
        for t in new_tokens:
            for n in new_requests:
                if t % n:
                    raise ProblemError(f"{t} new tokens do not split over {n} requests")
                out.append(prefill_workload(dims, tp, True, t, t // n, q_dtype=q_dtype))
        for q in chunk_queries:
            for kv in chunk_kv:
                out.append(prefill_workload(dims, tp, False, q, kv, q_dtype=q_dtype))
    return list(dict.fromkeys(out))


@dataclass
class PrefillSweepConfig:
    buckets: list
    db: Path = Path("results.db")
    device: str | None = None
    settings: MeasureSettings | None = None
    rounds: int = 5
    remeasure: bool = False
    command: str = ""
    family: object = None              # a prefill family (tests pass a stand-in); None: FlashInfer's


@dataclass
class PrefillOutcome:
    db: Path
    device_name: str
    run_id: int | None = None
    measured: int = 0
    cached: int = 0
    invalid: int = 0
    seconds: float = 0.0


def run_prefill_sweep(config: PrefillSweepConfig,
                      on_bucket: Callable[[PrefillWorkload, list], None] | None = None) -> PrefillOutcome:
    """Measure every bucket's candidates that this device has no trial of yet (all of them with
    `remeasure`) and store each trial; `on_bucket(workload, results)` after each bucket."""
    t_start = time.monotonic()
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    family = config.family or FlashInferPrefillFamily()
    avail = family.available(device)
    if not avail.ok:
        raise PrefillSweepError(f"the prefill family cannot run on {device}: {avail.reason}")
    if not config.buckets:
        raise PrefillSweepError("no prefill bucket to sweep")
    settings = config.settings or MeasureSettings(device=device, warmup=3, samples=20)
    device_name = core_device.detect_device().name if device.startswith("cuda") else "cpu"
    out = PrefillOutcome(Path(config.db), device_name)
    with ResultsStore(config.db) as store:
        for w in config.buckets:
            wid = store.workload_id(w, w.bytes(), w.flops())
            space = family.space(w)
            default = family.default_candidate(w)
            done = {} if config.remeasure else {
                r["candidate"]: r for r in store.trials("t.workload_id = ? and r.device_name = ?",
                                                        [wid, device_name], prefill=True)}
            todo = [c for c in space if c.key not in done]
            out.cached += len(space) - len(todo)
            results = measure_prefill([(family, c) for c in todo], w, settings,
                                      config.rounds) if todo else []
            if results and out.run_id is None:
                kind = GPU_RUN_KIND if device.startswith("cuda") else CPU_RUN_KIND
                out.run_id = store.add_run(capture_environment(kind, config.command))
            for c, r in zip(todo, results):
                store.add_trial(out.run_id, wid, c, r.status, r.samples or None,
                                invalid_reason=r.invalid_reason, message=r.message,
                                compile_s=r.compile_s, max_rel_error=r.max_rel_error,
                                sweep=SWEEP_NAME, is_default=c == default)
                out.measured += 1
                out.invalid += r.status != "ok"
            if on_bucket is not None:
                on_bucket(w, results)
    out.seconds = time.monotonic() - t_start
    return out


# ---------------------------------------------------------------- the choice

@dataclass(frozen=True)
class PrefillVerdict:
    """One prefill bucket's verdict (`verdict.decide`'s) and the bucket it is for."""

    workload: PrefillWorkload
    verdict: object                   # verdict.Verdict

    @property
    def bucket_key(self) -> tuple:
        """(causal, query tokens, mean KV tokens per request): the plugin's lookup statistic."""
        w = self.workload
        return (w.causal, *prefill_statistic(w.query_tokens, w.total_kv_tokens, w.requests))


def choose_prefill(records: list, p_threshold: float | None = None,
                   min_ratio: float | None = None) -> dict:
    """model key (vllm_metax.core.tuned_config.ModelDims) -> [PrefillVerdict], from the prefill trials
    of one device (`ResultsStore.records(prefill=True)`); the latest trial per candidate counts."""
    p = P_THRESHOLD if p_threshold is None else p_threshold
    m = MIN_RATIO if min_ratio is None else min_ratio
    by_workload: dict = {}
    for r in choosing.latest_trials(records):
        by_workload.setdefault(r.stored.id, []).append(r)
    out: dict = {}
    for wrecords in by_workload.values():
        w, first = wrecords[0].workload, wrecords[0].candidate
        if not isinstance(w, PrefillWorkload):
            raise ProblemError(f"not a prefill workload (layout {wrecords[0].stored.ragged!r})")
        measured = [choosing.measured_of(r) for r in wrecords]
        default = next((x.key for x in measured if x.is_default), None)
        v = decide(measured, default, first.family, first.page_size, p, m)
        dims = model_key(w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype, w.q_dtype)
        out.setdefault(dims, []).append(PrefillVerdict(w, v))
    for vs in out.values():
        vs.sort(key=lambda x: (not x.workload.causal, x.workload.query_tokens, x.workload.kv_len))
    return out


def prefill_buckets(verdicts: list) -> list:
    """Verdicts -> the tuned config's prefill buckets (a bucket without a valid candidate, or
    whose chosen backend the schema does not know, is left out: the plugin plans its default)."""
    out, seen = [], set()
    for pv in verdicts:
        v = pv.verdict
        if v.chosen is None or v.chosen.backend not in tc.PREFILL_BACKENDS or pv.bucket_key in seen:
            continue
        seen.add(pv.bucket_key)
        out.append(tc.PrefillBucket(*pv.bucket_key, {"backend": v.chosen.backend}, v.time_us,
                                    v.default_time_us, bool(v.significant)))
    return out


__all__ = ["PrefillOutcome", "PrefillSweepConfig", "PrefillSweepError", "PrefillVerdict",
           "choose_prefill", "plan_prefill_buckets", "prefill_buckets", "run_prefill_sweep"]
