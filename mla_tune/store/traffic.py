"""A server's recorded traffic (`VLLM_METAX_TRAFFIC`, written by `vllm_metax.core.traffic`), read
back: the decode steps per lookup key and the prefill plans per prefill key, on the recorder's
quarter-octave bins, and what the tuner derives from them.

    traffic = load_traffic("traffic.db")            # TrafficError: not a traffic file, empty ...
    part = traffic.select(num_heads=16)             # one model key (heads per rank, ranks, dtypes)
    part.decode_cells()      -> {(batch, context, q_len): steps}   on the lookup's log2 grid
    part.covering(0.99)      -> the fewest log2 cells holding 99% of the steps (most first)
    part.mix()               -> WorkloadMix of the observed keys: weights that snap to the
                                nearest measured bucket as the plugin's lookup does

The log2 grid is derived exactly from the fine bins (`vllm_metax.core.traffic.log2_cell`): a
length lands in the power of two it is nearest to on a log2 scale, as `ModelEntry.lookup` snaps.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.problem.workload import WorkloadMix
from mla_tune.store.sqlite_file import connect_readonly
from mla_tune.validate import InputError, is_sqlite
from vllm_metax.core import traffic as rec
from vllm_metax.core.tuned_config import ModelDims

DEFAULT_SHARE = 0.99         # the share of steps (plans) the traffic's buckets cover by default


class TrafficError(InputError):
    """A traffic file that cannot be used; the message names the file and the problem (bad
    input: one line, exit 2, like every InputError)."""


@dataclass(frozen=True)
class DecodeCount:
    """Decode steps of one recorded key: exact batch size and q_len, a fine context bin."""

    batch_size: int
    q_len: int
    context_bin: int
    steps: int

    @property
    def context(self) -> int:
        """A representative context of the bin (its geometric centre)."""
        return rec.bin_center(self.context_bin)


@dataclass(frozen=True)
class PrefillCount:
    """Prefill plans of one recorded key: plan kind, fine query-token and KV-per-request bins."""

    causal: bool
    query_bin: int
    kv_bin: int
    plans: int


@dataclass(frozen=True)
class ModelTraffic:
    """The recorded traffic of one model key."""

    label: str
    dims: ModelDims
    decode: tuple                   # DecodeCount
    prefill: tuple                  # PrefillCount
    path: str = ""

    @property
    def steps(self) -> int:
        return sum(d.steps for d in self.decode)

    @property
    def plans(self) -> int:
        return sum(p.plans for p in self.prefill)

    def decode_cells(self) -> dict:
        """(batch, context, q_len) on the log2 grid -> steps."""
        out: dict = {}
        for d in self.decode:
            k = (log2_of(d.batch_size), rec.log2_cell(d.context_bin), d.q_len)
            out[k] = out.get(k, 0) + d.steps
        return out

    def prefill_cells(self) -> dict:
        """(causal, query tokens, KV tokens per request) on the log2 grid -> plans."""
        out: dict = {}
        for p in self.prefill:
            q, kv = rec.log2_cell(p.query_bin), rec.log2_cell(p.kv_bin)
            if p.causal:
                kv = min(kv, q)         # a causal plan's KV per request is at most its queries
            k = (p.causal, q, kv)
            out[k] = out.get(k, 0) + p.plans
        return out

    def covering(self, share: float = DEFAULT_SHARE) -> list:
        """The fewest log2 decode cells (batch, context, q_len) that hold at least `share` of the
        steps, most steps first (ties: smaller batch, context, q_len first)."""
        return cover(self.decode_cells(), share)

    def prefill_covering(self, share: float = DEFAULT_SHARE) -> list:
        """`covering` for the prefill plans: (causal, query tokens, KV tokens per request)."""
        return cover(self.prefill_cells(), share)

    def mix(self) -> WorkloadMix:
        """The observed decode keys as weights (step counts), each snapping to the nearest
        measured bucket as the plugin's lookup does (`choose.bucket_weights`)."""
        w: dict = {}
        for d in self.decode:
            k = (d.batch_size, d.context, d.q_len)
            w[k] = w.get(k, 0.0) + float(d.steps)
        return WorkloadMix(w, snap=True, source=f"traffic {self.path or '-'} ({self.label}, "
                                                f"{self.steps} decode steps)",
                           model_key=(self.dims.num_heads, self.dims.kv_lora_rank))


def cover(cells: dict, share: float) -> list:
    """The fewest keys of `cells` (key -> count) whose counts reach `share` of the total, most
    counted first."""
    if not 0 < share <= 1:
        raise TrafficError(f"the covered share must be in (0, 1], got {share}")
    total = sum(cells.values())
    out, have = [], 0
    for k, n in sorted(cells.items(), key=lambda kv: (-kv[1], kv[0])):
        if have >= share * total:
            break
        out.append(k)
        have += n
    return out


def log2_of(x: int) -> int:
    """The power of two `x` is nearest to on a log2 scale (as the lookup snaps on such a grid)."""
    return rec.log2_cell(rec.fine_bin(int(x)))


@dataclass(frozen=True)
class Traffic:
    """Everything one traffic file holds: per model key its decode and prefill counts."""

    path: str
    models: tuple                   # ModelTraffic
    writers: int = 0                # processes that flushed into it
    meta: dict = field(default_factory=dict)

    @property
    def device_name(self) -> str | None:
        """The device the server ran on (whose tuned config it served), if recorded."""
        return self.meta.get("device_name") or None

    def select(self, num_heads: int | None = None, kv_lora_rank: int | None = None) -> ModelTraffic:
        """The one model key matching the given dims (all of them when none is given); a
        TrafficError naming the keys recorded when none or several match."""
        hit = [m for m in self.models
               if (num_heads is None or m.dims.num_heads == num_heads)
               and (kv_lora_rank is None or m.dims.kv_lora_rank == kv_lora_rank)]
        if len(hit) == 1:
            return hit[0]
        have = "; ".join(m.label for m in self.models) or "none"
        want = ", ".join(f"{k} {v}" for k, v in (("heads per rank", num_heads),
                                                  ("kv_lora_rank", kv_lora_rank)) if v is not None)
        if not hit:
            raise TrafficError(f"{self.path}: no recorded traffic for {want or 'any model'} "
                               f"(recorded: {have})")
        raise TrafficError(f"{self.path}: traffic of several models recorded ({have}): name one "
                           "(--tp or --model decides the heads per rank)")


def load_traffic(path: str | Path) -> Traffic:
    """Read a traffic file (read-only; nothing is written beside it). TrafficError for a path
    that is not one, a file of another bin layout, or one with no step or plan recorded."""
    p = Path(path)
    if not p.is_file():
        raise TrafficError(f"traffic file {p}: {'a folder' if p.is_dir() else 'no such file'} "
                           f"(record one with {rec.TRAFFIC_ENV}=<file> on the server)")
    if not is_sqlite(p):
        raise TrafficError(f"traffic file {p} is not a SQLite file")
    try:
        conn = connect_readonly(p)
        try:
            tables = {r[0] for r in conn.execute("select name from sqlite_master where type='table'")}
            if not {"meta", "models", "decode", "prefill"} <= tables:
                raise TrafficError(f"{p} is not a traffic file (no decode/prefill tables; record one "
                                   f"with {rec.TRAFFIC_ENV}=<file> on the server)")
            meta = dict(conn.execute("select key, value from meta"))
            if meta.get("bins_per_octave") != str(rec.BINS_PER_OCTAVE):
                raise TrafficError(f"{p}: recorded with {meta.get('bins_per_octave')} bins per "
                                   f"octave; this mla-tune reads {rec.BINS_PER_OCTAVE}")
            models = []
            for label, h, r, rope, qd, kd in conn.execute("select * from models order by model"):
                dec = tuple(DecodeCount(int(b), int(q), int(c), int(n)) for b, q, c, n in conn.execute(
                    "select batch_size, q_len, context_bin, steps from decode where model = ? "
                    "and steps > 0 and batch_size > 0 and q_len > 0 order by 1, 2, 3", (label,)))
                pre = tuple(PrefillCount(bool(c), int(q), int(k), int(n)) for c, q, k, n in conn.execute(
                    "select causal, query_bin, kv_bin, plans from prefill where model = ? and "
                    "plans > 0 order by 1, 2, 3", (label,)))
                models.append(ModelTraffic(label, ModelDims(int(h), int(r), int(rope), qd, kd),
                                           dec, pre, str(p)))
            writers = conn.execute("select count(*) from writers").fetchone()[0] \
                if "writers" in tables else 0
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise TrafficError(f"traffic file {p}: {e}") from None
    models = [m for m in models if m.decode or m.prefill]
    if not models:
        raise TrafficError(f"{p}: no decode step or prefill plan recorded yet (the server flushes "
                           f"every {rec.FLUSH_SECONDS:.0f} s and at exit)")
    return Traffic(str(p), tuple(models), writers, meta)


def grid_steps(a: int, b: int) -> float:
    """How many log2 grid steps apart two sizes are."""
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


__all__ = ["DEFAULT_SHARE", "DecodeCount", "ModelTraffic", "PrefillCount", "Traffic", "TrafficError",
           "cover", "grid_steps", "load_traffic", "log2_of"]
