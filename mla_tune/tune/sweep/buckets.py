"""What a sweep measures: its buckets (model x TP size x batch x context x q_len, per-request
lengths), the device's default space, and the parsers of the flag values that name them.

    plan_buckets(model, tp_sizes, batches, contexts, ...) -> [Bucket]
    default_space(device)                                  -> DefaultSpace (GPU: the H200 sweep)
    parse_sizes('1-128'), parse_duration('9m'), resolve_lengths('zipf' | FILE)
    measure_settings(device, samples, warmup)              -> how a sweep samples on the device
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mla_tune.measure.sampling import MIN_SAMPLES
from mla_tune.measure.timing import KernelTimer
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.defaults import SWEEP_PAGE_SIZES
from mla_tune.problem.workload import (RAGGED_KINDS, LengthTrace, ModelDims, ProblemError, Workload,
                                      load_trace, log2_grid, workload_for)
from mla_tune.validate import INT, InputError, MAX_LIST


# ---------------------------------------------------------------- buckets

@dataclass(frozen=True)
class Bucket:
    """One workload the sweep tunes: a model at one TP size, batch size, context length, q_len."""

    model: str
    tp_size: int | None
    workload: Workload

    @property
    def label(self) -> str:
        tp = f"TP{self.tp_size} " if self.tp_size else ""
        return f"{self.model} {tp}{self.workload.label()}"


def plan_buckets(model: ModelDims, tp_sizes: Sequence[int], batch_sizes: Sequence[int],
                 context_lens: Sequence[int], q_lens: Sequence[int] = (1,), ragged: str = "uniform",
                 q_dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                 trace: LengthTrace | None = None) -> list[Bucket]:
    """Every (TP, q_len, batch, context) combination; raises ProblemError on impossible values
    (a TP size that does not divide the heads, q_len > context, ...). q_len > 1 buckets are
    speculative decode: the q_len queries of a request attend causally. With `trace`, each
    bucket's lengths are drawn from that recorded trace (LengthTrace.sample)."""
    out, seen = [], set()
    for tp in tp_sizes:
        for q in q_lens:
            for b in batch_sizes:
                for c in context_lens:
                    if q > c:
                        raise ProblemError(f"q_len {q} is longer than context length {c}")
                    w = workload_for(model, tp, b, c, q_len=q, ragged=ragged, q_dtype=q_dtype,
                                     kv_dtype=kv_dtype, trace=trace)
                    if w not in seen:
                        seen.add(w)
                        out.append(Bucket(model.name, tp, w))
    return out


_SIZE = re.compile(r"^\s*([0-9]{1,12})\s*([kKmM]?)\s*$")     # ASCII digits: "٦٤" is no size


def _size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 16, 4K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def parse_size(text: str) -> int:
    """One size as every size flag writes it: '6144', '6k', '4K', '1M' -> an int; ValueError."""
    return _size(text)


def parse_sizes(text: str, kind: str | None = None) -> list[int]:
    """'1-128' (powers of two from 1 to 128), '1K-32K', '1,4,16' or '4096' -> sorted sizes; with
    `kind` ("batch", "context") each is checked against that kind's range."""
    try:
        text = text.strip()
        if "-" in text or ":" in text:
            lo, hi = re.split(r"[-:]", text, maxsplit=1)
            lo_v, hi_v = _size(lo), _size(hi)
            if kind and hi_v > INT[kind].hi:
                raise ValueError(f"{kind} sizes must be in {INT[kind].lo}..{INT[kind].hi}")
            grid = log2_grid(lo_v, hi_v)
            off = [v for v in (lo_v, hi_v) if v & (v - 1)]
            if off:     # never measure other sizes than the ones written without saying so
                up = 1 << (hi_v - 1).bit_length()
                raise ValueError(
                    f"a range steps over powers of two and {off[0]} is not one: "
                    f"{lo.strip()}-{hi.strip()} would measure {grid[0]}-{grid[-1]}; write "
                    f"{grid[0]}-{grid[-1]}" + (f" or {grid[0]}-{up}" if up != grid[-1] else "")
                    + ", or list each size, comma-separated")
            return grid
        parts = text.split(",")
        if not text or any(not t.strip() for t in parts):
            raise ValueError("empty entry")
        if len(parts) > MAX_LIST:
            raise ValueError(f"at most {MAX_LIST} values")
        values = sorted({_size(t) for t in parts})
        if values[0] < 1:
            raise ValueError("sizes must be positive")
        if kind:
            for x in values:
                INT[kind].check(f"{kind} size", x)
        return values
    except (ValueError, ProblemError, InputError) as e:
        raise ValueError(f"bad size list {text[:80]!r}: {e}") from None


def parse_duration(text: str) -> float:
    """'90', '90s', '9m', '1h', '1h30m' -> seconds; '0' or 'none' -> 0 (no limit)."""
    t = text.strip().lower()
    if t in ("", "0", "none", "off"):
        return 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms]?)", t)
    if not parts or "".join(n + u for n, u in parts) != t.replace(" ", ""):
        raise ValueError(f"bad duration {text!r} (use e.g. 600, 90s, 9m, 1h30m)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "": 1}[u] for n, u in parts)


@dataclass(frozen=True)
class DefaultSpace:
    """What a sweep measures when not told otherwise, per device kind."""

    tp_sizes: tuple
    batch_sizes: tuple
    context_lens: tuple
    page_sizes: tuple
    samples: int
    warmup: int
    timeout_s: float
    time_budget_s: float
    # (length distribution, batch sizes, context lengths) measured besides the uniform grid
    ragged: tuple = ()


# ragged buckets of the default GPU sweep: Zipf-tailed lengths where a batch is large enough for
# raggedness to change the schedule (the numpy schedule's cluster balance, KV chunking)
DEFAULT_RAGGED = (("zipf", (32, 128), (4096, 16384)),)


def default_space(device: str) -> DefaultSpace:
    """GPU: DeepSeek-V3 at TP1 and TP8, batch 1-128 x context 1K-32K on log2 steps with uniform
    lengths (96 buckets) plus Zipf-tailed lengths at batch 32/128 x context 4K/16K (8 buckets),
    sized with the time budget to finish in under 10 minutes on an H200, JIT included. CPU: a
    small space the torch reference covers in seconds."""
    if str(device).startswith("cuda"):
        return DefaultSpace((1, 8), tuple(log2_grid(1, 128)), tuple(log2_grid(1024, 32768)),
                            SWEEP_PAGE_SIZES, samples=20, warmup=1, timeout_s=180.0, time_budget_s=540.0,
                            ragged=DEFAULT_RAGGED)
    return DefaultSpace((8,), (1, 4), (256, 1024), SWEEP_PAGE_SIZES, samples=10, warmup=2,
                        timeout_s=120.0, time_budget_s=0.0)


def resolve_lengths(spec: str) -> tuple[str, LengthTrace | None]:
    """--lengths: a distribution name (RAGGED_KINDS) -> (name, None); a CSV file of request
    lengths -> (its trace kind, the trace). Raises ProblemError (unknown name, unreadable or
    malformed file)."""
    spec = (spec or "").strip()
    if spec in RAGGED_KINDS:
        return spec, None
    looks_like_file = any(ch in spec for ch in "/\\.") or Path(spec).exists()
    if not spec or not looks_like_file:
        raise ProblemError(f"unknown length distribution {spec[:80]!r}; one of "
                           f"{', '.join(RAGGED_KINDS)}, or a CSV file of request lengths")
    trace = load_trace(spec)
    return trace.kind, trace


SWEEP_PLAN_SAMPLES = 5     # host plan() timings per candidate in a sweep (shown, never chosen by)


def measure_settings(device: str, samples: int, warmup: int) -> MeasureSettings:
    """How a sweep measures on `device`: up to `samples` per candidate, stopping from
    sampling.MIN_SAMPLES on where the median is already known (mla_tune.measure.sampling says why
    verdicts keep their power); on a GPU in rounds of one timed-graph replay
    (KernelTimer.RUNS_PER_GRAPH samples), so no sample taken is thrown away. The host plan time
    (`plan_us`) is reported, not chosen by, so a sweep takes SWEEP_PLAN_SAMPLES of it per
    candidate (`mla-tune bench` takes more); a GPU sweep's single warm-up run comes on top of
    the correctness run and the two eager runs before capture (timing.KernelTimer), so first
    launches stay out of every sample."""
    rounds = 5
    if str(device).startswith("cuda"):
        rounds = max(1, math.ceil(samples / KernelTimer.RUNS_PER_GRAPH))
    return MeasureSettings(device=device, warmup=warmup, samples=samples,
                           plan_samples=SWEEP_PLAN_SAMPLES, min_samples=min(MIN_SAMPLES, samples),
                           rounds=rounds)


def detect_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


GPU_DB = Path("results.db")
CPU_DB = Path("results-cpu.db")     # the CPU reference's numbers never mix with a GPU's


def default_db(device: str | None = None) -> Path:
    """The results DB a sweep (and report, emit) uses when none is named: results.db on a GPU,
    results-cpu.db without CUDA (the CPU torch reference is not a serving device)."""
    return GPU_DB if str(device or detect_device()).startswith("cuda") else CPU_DB


def journal_path_for(db: str | Path) -> Path:
    """Where the optuna study of a DB lives: results.db -> results.optuna.log (optuna-dashboard)."""
    db = Path(db)
    return db.with_name(db.stem + ".optuna.log")


__all__ = ["Bucket", "CPU_DB", "DEFAULT_RAGGED", "DefaultSpace", "GPU_DB", "default_db",
           "default_space", "detect_device", "journal_path_for", "measure_settings",
           "parse_duration", "parse_sizes", "plan_buckets", "resolve_lengths"]
