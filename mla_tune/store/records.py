"""The typed trial record at the store boundary: one stored trial, its workload, candidate and samples.

`ResultsStore.records()` (and `select_trials`) return `TrialRecord`s, so readers (the choice, the
report, emit, bench scripts) never re-parse raw rows. `TrialRecord.from_row` converts an old-style
`ResultsStore.trials()` dict for code that still holds those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from mla_tune.families.base import Candidate
from mla_tune.problem.defaults import KERNEL_METRIC
from mla_tune.problem.prefill import LAYOUTS as PREFILL_LAYOUTS, PrefillWorkload
from mla_tune.problem.workload import Workload
from mla_tune.store.stats import stats_of

# what readers group and show by; the problem Workload has every column (softmax scale, seed too)
_SHOWN_COLUMNS = ("model", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "batch_size",
                  "context_len", "q_len", "ragged", "q_dtype", "kv_dtype", "total_kv_tokens",
                  "bytes", "flops")


@dataclass(frozen=True)
class StoredWorkload:
    """A `workloads` row as stored: what a trial was measured on, whether or not this version's
    `Workload` still accepts it (`problem`, the whole workload, is None then)."""

    id: int
    model: str
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    batch_size: int
    context_len: int
    q_len: int
    ragged: str
    q_dtype: str
    kv_dtype: str
    total_kv_tokens: int
    bytes: int
    flops: int
    problem: Workload | PrefillWorkload | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_row(cls, row: Mapping) -> "StoredWorkload":
        """From a row holding the workload columns (a trials() row: `workload_id` is its id)."""
        wid = row["workload_id"] if "workload_id" in row else row["id"]
        return cls(wid, **{k: row[k] for k in _SHOWN_COLUMNS}, problem=_problem(row))

    @property
    def bucket(self) -> tuple[int, int, int]:
        """(batch, context, q_len): the bucket a trial belongs to."""
        return (self.batch_size, self.context_len, self.q_len)

    @property
    def entry_key(self) -> tuple:
        """What makes one tuned-config model entry: model, heads per rank, dims, dtypes, lengths."""
        return (self.model, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.q_dtype,
                self.kv_dtype, self.ragged)


def _problem(row: Mapping) -> Workload | PrefillWorkload | None:
    try:
        if row.get("ragged") in PREFILL_LAYOUTS:
            return PrefillWorkload.from_row(row)
        return Workload.from_row(row)   # a ragged workload with its stored per-request lengths
    except Exception:  # noqa: BLE001 - any stored value the model refuses (another version's row)
        return None


@dataclass(frozen=True)
class TrialRecord:
    """One stored trial: the candidate measured on a workload, its status and raw samples, and
    the run (device, kind, ceilings) it was measured in. Statistics are derived on read."""

    id: int
    run_id: int
    stored: StoredWorkload
    candidate: Candidate
    key: str                          # the candidate key as stored (the trial's identity)
    status: str                       # ok | invalid
    invalid_reason: str | None
    message: str
    samples: Mapping[str, tuple]      # metric -> values, in the order taken
    is_default: bool | None           # None: stored before the sweep marked defaults
    device_name: str
    run_kind: str
    copy_gbps: float | None = None
    matmul_tflops: float | None = None
    compile_s: float | None = None
    max_rel_error: float | None = None
    sweep: str = ""
    claim: str | None = None
    started_at: str | None = None
    finished_at: str | None = None

    @classmethod
    def from_row(cls, row: Mapping, stored: StoredWorkload | None = None) -> "TrialRecord":
        """From a `ResultsStore.trials()` row (`stored`: its workload, when already built)."""
        params = dict(row.get("params") or {})
        default = row.get("is_default")
        return cls(
            id=row["id"], run_id=row["run_id"],
            stored=stored if stored is not None else StoredWorkload.from_row(row),
            candidate=Candidate(row["family"], row["backend"], int(row["page_size"]), params),
            key=row["candidate"], status=row["status"], invalid_reason=row.get("invalid_reason"),
            message=row.get("message") or "",
            samples=MappingProxyType({m: tuple(v) for m, v in (row.get("samples") or {}).items()}),
            is_default=None if default is None else bool(default),
            device_name=row.get("device_name") or "", run_kind=row.get("run_kind") or "",
            copy_gbps=row.get("copy_gbps"), matmul_tflops=row.get("matmul_tflops"),
            compile_s=row.get("compile_s"), max_rel_error=row.get("max_rel_error"),
            sweep=row.get("sweep") or "", claim=row.get("claim"),
            started_at=row.get("started_at"), finished_at=row.get("finished_at"))

    @property
    def workload(self) -> Workload | PrefillWorkload | None:
        """The problem workload measured, decode or prefill (None if this version no longer
        accepts the stored one)."""
        return self.stored.problem

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def values(self, metric: str = KERNEL_METRIC) -> tuple:
        """The raw samples of one metric (empty when none were taken)."""
        return self.samples.get(metric, ())

    def stats(self, metric: str = KERNEL_METRIC):
        """Statistics (`Stats`) of one metric's samples (kernel time by default), None without any."""
        return stats_of(list(self.values(metric)))


def as_records(rows) -> list[TrialRecord]:
    """TrialRecords from records or old-style `ResultsStore.trials()` dicts (one StoredWorkload
    per workload id)."""
    out, stored = [], {}
    for r in rows:
        if isinstance(r, TrialRecord):
            out.append(r)
            continue
        wid = r["workload_id"]
        if wid not in stored:
            stored[wid] = StoredWorkload.from_row(r)
        out.append(TrialRecord.from_row(r, stored[wid]))
    return out


__all__ = ["StoredWorkload", "TrialRecord", "as_records"]
