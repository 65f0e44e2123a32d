"""The tuned config as data: its dataclasses (a device's file holds model entries, an entry its
buckets), the nearest-bucket lookups inside an entry, and the bounds every value is checked
against (here by the reader, `parse`, and in mla_tune/validate.py for every mla-tune input).

A file holds one device's choices, named in vLLM's tuned-config style
(`device_name=NVIDIA_H200.json`). Per model dims (heads per rank, kv_lora_rank, rope dim, dtypes)
it records a global choice (attention-backend order, KV page size), per-bucket plan-time
choices per kernel family (FlashInfer backend; Triton num_kv_splits) and, optionally, the MLA
prefill section: per prefill bucket the FlashInfer ragged-prefill backend (fa2/fa3). A prefill
bucket is keyed by the plan's kind (causal new tokens, or a non-causal context chunk), its total
query tokens and its mean KV tokens per request (`vllm_metax.core.decisions.prefill_statistic`).
Configs without a prefill section stay valid: prefill then plans the device default.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field

from vllm_metax.core import choices

SCHEMA_VERSION = 1
# the vLLM attention backends an entry's backend_order may name: those the kernel specs name
# (`KernelSpec.attention_backend`); their untuned order is the profile's (`Profile.mla_order`)
ATTENTION_BACKENDS = frozenset(s.attention_backend for s in choices.SPECS.values() if s.attention_backend)
FAMILIES = tuple(choices.KNOBS)   # one per kernel spec (choices.SPECS)

# What a value may be, for the reader here and for every mla-tune input (mla_tune/validate.py uses
# these same bounds): a value outside them is refused, never clamped.
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # KV block sizes: powers of two up to vLLM's largest
# MLA prefill backend values a prefill bucket may name: FlashInfer's ragged prefill with fa2 or fa3
# ("auto" is FlashInfer's policy, never a tuned value) and vLLM's FA3 varlen prefill on Hopper.
FLASHINFER_PREFILL_BACKENDS = ("fa2", "fa3")
VLLM_FA3_PREFILL = "vllm_fa3"
PREFILL_BACKENDS = FLASHINFER_PREFILL_BACKENDS + (VLLM_FA3_PREFILL,)
MAX_BATCH = 65536              # requests in one decode step
MAX_CONTEXT = 1 << 22          # KV tokens per request (4M; DeepSeek-V3 serves 160K)
MAX_PREFILL_TOKENS = 1 << 22   # query / KV tokens of one prefill plan
MAX_Q_LEN = 1024               # query tokens per request in one step (speculative decode)
MAX_HEADS = 1024               # attention heads per rank
MAX_HEAD_DIM = 4096            # kv_lora_rank, qk_rope_head_dim
DTYPES = ("bfloat16", "float16")
MAX_NAME = 200                 # device and model names: characters


class TunedConfigError(ValueError):
    """A tuned-config file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelDims:
    num_heads: int            # per rank, after tensor parallelism
    kv_lora_rank: int
    qk_rope_head_dim: int
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"


@dataclass(frozen=True)
class FamilyChoice:
    """A kernel family's best parameters in one bucket, with what they measured."""

    params: dict                       # flashinfer: {"backend": "fa3"}; triton: {"num_kv_splits": 8}
    time_us: float | None = None
    default_time_us: float | None = None
    significant: bool = False          # beat the default by a significant margin

    @property
    def gain(self) -> float | None:
        return speedup(self.default_time_us, self.time_us)


def speedup(default_time_us: float | None, time_us: float | None) -> float | None:
    """default time / chosen time (None unless both were measured)."""
    if time_us and default_time_us:
        return default_time_us / time_us
    return None


@dataclass(frozen=True)
class Bucket:
    batch_size: int
    context_len: int
    q_len: int
    families: dict                     # family -> FamilyChoice
    best_family: str | None = None


@dataclass(frozen=True)
class PrefillBucket:
    """One MLA prefill bucket: the plan kind (`causal`: the new tokens; else a context chunk), the
    plan's total query tokens and mean KV tokens per request, and the ragged-prefill backend
    chosen there (`params`: {"backend": "fa2" | "fa3"}) with what it measured."""

    causal: bool
    query_tokens: int
    kv_len: int
    params: dict
    time_us: float | None = None
    default_time_us: float | None = None
    significant: bool = False

    @property
    def backend(self) -> str:
        return self.params["backend"]


@dataclass(frozen=True)
class Lookup:
    """A bucket found for a request; `exact` is False when it snapped, `in_range` False outside."""

    bucket: Bucket
    exact: bool
    in_range: bool


@dataclass
class ModelEntry:
    dims: ModelDims
    page_size: int
    backend_order: list                 # attention backends, best first
    buckets: list
    model: str | None = None
    tp_size: int | None = None
    reason: str = ""
    prefill: list = field(default_factory=list)     # PrefillBucket; empty: prefill untuned
    _grid: dict = field(default_factory=dict, repr=False, compare=False)
    _prefill_grid: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        pgrid: dict = {}
        for p in self.prefill:
            pgrid.setdefault(p.causal, {}).setdefault(p.query_tokens, {})[p.kv_len] = p
        self._prefill_grid = {c: (sorted(qs), {q: (sorted(ks), ks) for q, ks in qs.items()})
                              for c, qs in pgrid.items()}
        grid: dict = {}
        for b in self.buckets:
            grid.setdefault(b.q_len, {}).setdefault(b.batch_size, {})[b.context_len] = b
        self._grid = {
            q: (sorted(bs), {bb: (sorted(cs), cs) for bb, cs in bs.items()}) for q, bs in grid.items()
        }

    def lookup(self, batch_size: int, context_len: int, q_len: int = 1) -> Lookup | None:
        """The nearest tuned bucket on a log2 scale (batch first, then context)."""
        if not self._grid:
            return None
        q = q_len if q_len in self._grid else nearest(sorted(self._grid), q_len)
        batches, per_batch = self._grid[q]
        b = nearest(batches, batch_size)
        contexts, cells = per_batch[b]
        c = nearest(contexts, context_len)
        in_range = (batches[0] <= batch_size <= batches[-1] and contexts[0] <= context_len <= contexts[-1])
        exact = q == q_len and b == batch_size and c == context_len
        return Lookup(cells[c], exact, in_range)

    def prefill_lookup(self, causal: bool, query_tokens: int, kv_len: int) -> PrefillBucket | None:
        """The nearest tuned prefill bucket of this plan kind on a log2 scale (query tokens first,
        then KV tokens per request); None when no bucket of that kind is tuned."""
        found = self._prefill_grid.get(bool(causal))
        if found is None:
            return None
        qs, per_q = found
        q = nearest(qs, query_tokens)
        ks, cells = per_q[q]
        return cells[nearest(ks, kv_len)]


def nearest(sorted_keys: list, value: int) -> int:
    """The key of `sorted_keys` nearest `value` on a log2 scale (a tie: the smaller): the one
    snapping rule of every tuned-config lookup, and of the tuner's mix weights."""
    i = bisect.bisect_left(sorted_keys, value)
    if i == 0:
        return sorted_keys[0]
    if i == len(sorted_keys):
        return sorted_keys[-1]
    lo, hi = sorted_keys[i - 1], sorted_keys[i]
    lv = math.log2(max(value, 1))
    return lo if lv - math.log2(lo) <= math.log2(hi) - lv else hi


@dataclass
class TunedConfig:
    device_name: str
    provenance: dict
    models: list
    schema_version: int = SCHEMA_VERSION
    path: str | None = None

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "device_name": self.device_name,
            "provenance": self.provenance,
            "models": [
                {
                    "model": m.model, "tp_size": m.tp_size, "dims": asdict(m.dims),
                    "global": {"page_size": m.page_size, "backend_order": list(m.backend_order),
                               "reason": m.reason},
                    "buckets": [
                        {"batch_size": b.batch_size, "context_len": b.context_len, "q_len": b.q_len,
                         "best_family": b.best_family,
                         "families": {f: {"params": c.params, "time_us": c.time_us,
                                          "default_time_us": c.default_time_us,
                                          "significant": c.significant}
                                      for f, c in b.families.items()}}
                        for b in m.buckets
                    ],
                    **({"prefill": {"buckets": [
                        {"causal": p.causal, "query_tokens": p.query_tokens, "kv_len": p.kv_len,
                         "params": p.params, "time_us": p.time_us,
                         "default_time_us": p.default_time_us, "significant": p.significant}
                        for p in m.prefill]}} if m.prefill else {}),
                }
                for m in self.models
            ],
        }

