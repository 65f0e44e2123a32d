"""The MLA problem model: model dimensions (from published config.json files), workloads, buckets."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from importlib import resources
from typing import Sequence

from mla_tune.validate import FLOAT, INT, MAX_KV_TOKENS, InputError, ascii_int, input_text
from vllm_metax.core.tuned_config import MAX_HEAD_DIM, MAX_HEADS

DTYPES = ("bfloat16", "float16")


class ProblemError(ValueError):
    """A model, TP size or workload that cannot be tuned (message is shown to the user)."""


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN attention-temperature factor, as DeepSeek's and vLLM's rotary code define it."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelDims:
    """The attention dimensions of one MLA model (before tensor parallelism)."""

    name: str
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int = 128
    rope_scaling_factor: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_nope + qk_rope), times mscale^2 under YaRN (what vLLM's DeepSeek layer passes)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.mscale_all_dim:
            m = yarn_get_mscale(self.rope_scaling_factor, self.mscale_all_dim)
            scale *= m * m
        return scale

    def heads_per_rank(self, tp_size: int) -> int:
        if tp_size < 1 or self.num_heads % tp_size:
            raise ProblemError(
                f"tensor-parallel size {tp_size} does not divide {self.name}'s {self.num_heads} heads"
            )
        return self.num_heads // tp_size

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict) -> "ModelDims":
        """Build from a Hugging Face config.json dict (DeepSeek-V2/V3 style keys)."""
        try:
            rs = cfg.get("rope_scaling") or {}
            return cls(
                name=name,
                num_heads=int(cfg["num_attention_heads"]),
                kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                v_head_dim=int(cfg.get("v_head_dim", 128)),
                rope_scaling_factor=float(rs.get("factor", 1.0)) if rs else 1.0,
                mscale_all_dim=float(rs.get("mscale_all_dim", 0.0) or 0.0) if rs else 0.0,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProblemError(f"model config for {name!r} lacks or mangles an MLA field: {e}") from None


@lru_cache(maxsize=1)
def _preset_table() -> dict:
    return json.loads(resources.files("mla_tune.problem").joinpath("models.json").read_text())


def preset_names() -> list[str]:
    return sorted(_preset_table())


def model_preset(name: str) -> ModelDims:
    """A model by preset name (case-insensitive), e.g. 'deepseek-v3'."""
    table = _preset_table()
    key = name.lower()
    if key not in table:
        raise ProblemError(f"unknown model {name!r}; presets: {', '.join(sorted(table))}")
    return ModelDims.from_hf_config(key, table[key])


def custom_model(num_heads: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                 qk_nope_head_dim: int = 128, rope_scaling_factor: float = 1.0,
                 mscale_all_dim: float = 0.0) -> ModelDims:
    """A model given by its dims rather than a preset name."""
    for label, v, hi in (("num_heads", num_heads, MAX_HEADS), ("kv_lora_rank", kv_lora_rank, MAX_HEAD_DIM),
                         ("qk_rope_head_dim", qk_rope_head_dim, MAX_HEAD_DIM),
                         ("qk_nope_head_dim", qk_nope_head_dim, MAX_HEAD_DIM)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ProblemError(f"{label} must be an integer in 1..{hi}, got {v!r}")
    return ModelDims(f"custom-h{num_heads}-r{kv_lora_rank}-p{qk_rope_head_dim}", num_heads,
                     kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, 128,
                     rope_scaling_factor, mscale_all_dim)


@dataclass(frozen=True)
class Workload:
    """One decode step's shape: heads per rank, batch, per-request context lengths, q_len, dtypes.

    `seq_lens` are KV lengths including the q_len new tokens. A uniform workload has all lengths
    equal; a ragged one is drawn from a distribution with a fixed seed so it is reproducible.
    """

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    softmax_scale: float
    batch_size: int
    context_len: int
    q_len: int = 1
    ragged: str = "uniform"
    seed: int = 0
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    model: str = "custom"
    # the per-request lengths themselves, where the kind alone does not give them (a recorded
    # trace, "trace:<digest>") or as stored with the workload; not part of its identity (`key`):
    # the kind, batch, context and seed determine them
    lengths: tuple | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for label, kind, v in (("batch size", "batch", self.batch_size),
                               ("context length", "context", self.context_len),
                               ("q_len", "q_len", self.q_len), ("heads per rank", "heads", self.num_heads)):
            r = INT[kind]
            if isinstance(v, bool) or not isinstance(v, int) or not r.lo <= v <= r.hi:
                raise ProblemError(f"{label} must be in {r.lo}..{r.hi}, got {v!r}")
        if self.q_len > self.context_len:
            raise ProblemError(f"q_len must be in [1, context_len], got {self.q_len}")
        if self.batch_size * self.context_len > MAX_KV_TOKENS:
            raise ProblemError(f"batch {self.batch_size} x context {self.context_len} is more than "
                               f"{MAX_KV_TOKENS} KV tokens in one step (the KV cache would not fit)")
        check_length_kind(self.ragged)
        for d in (self.q_dtype, self.kv_dtype):
            if d not in DTYPES:
                raise ProblemError(f"unsupported dtype {d!r}; one of {DTYPES}")
        if self.lengths is not None:
            lens = tuple(self.lengths)
            if len(lens) != self.batch_size or any(
                    isinstance(x, bool) or not isinstance(x, int) or not self.q_len <= x <= MAX_LENGTH
                    for x in lens):
                raise ProblemError(f"per-request lengths must be {self.batch_size} integers in "
                                   f"{self.q_len}..{MAX_LENGTH}")
            object.__setattr__(self, "lengths", lens)
        elif is_trace(self.ragged):
            raise ProblemError(f"a {self.ragged} workload needs its per-request lengths "
                               "(the trace they were drawn from)")

    @property
    def seq_lens(self) -> list[int]:
        if self.lengths is not None:
            return list(self.lengths)
        return ragged_lengths(self.ragged, self.batch_size, self.context_len, self.q_len, self.seed)

    @property
    def total_kv_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def key(self) -> dict:
        """The columns that identify this workload in the results store."""
        return {k: v for k, v in asdict(self).items() if k != "lengths"}

    @classmethod
    def from_row(cls, row) -> "Workload":
        """The workload a stored row describes (a workloads row, or a trial row joined with
        one), with the per-request lengths stored beside it when there are any (`seq_lens`,
        JSON; schema 4 on), else computed from the kind. Raises ProblemError."""
        names = [f.name for f in fields(cls) if f.name != "lengths"]
        keys = row.keys() if hasattr(row, "keys") else ()
        try:
            values = {n: row[n] for n in names}
        except (KeyError, IndexError) as e:
            raise ProblemError(f"stored workload lacks {e}") from None
        stored = row["seq_lens"] if "seq_lens" in keys else None
        lengths = None
        if stored:
            try:
                lengths = tuple(json.loads(stored))
            except (TypeError, ValueError):
                raise ProblemError("stored per-request lengths are not a JSON list") from None
        return cls(**values, lengths=lengths)

    def lengths_json(self) -> str | None:
        """The per-request lengths to store with a ragged workload (None for uniform ones)."""
        return None if self.ragged == "uniform" else json.dumps(self.seq_lens)

    def label(self) -> str:
        r = "" if self.ragged == "uniform" else f" {self.ragged}"
        q = "" if self.q_len == 1 else f" q{self.q_len}"
        return f"H{self.num_heads} B{self.batch_size} L{self.context_len}{q}{r}"


RAGGED_KINDS = ("uniform", "uniform-random", "lognormal", "zipf")
TRACE_PREFIX = "trace:"          # + the first 16 hex digits of a recorded trace's digest
ZIPF_EXPONENT = 1.5              # power-law tail index: finite mean, most requests short, a few long
MAX_LENGTH = 1 << 22             # one request's KV length
# CSV columns a recorded trace's per-request lengths are read from, by priority (case-insensitive)
LENGTH_COLUMNS = ("context_len", "seq_len", "kv_len", "length", "prompt_len", "input_len",
                  "prompt_tokens", "num_tokens", "tokens")
MAX_TRACE_ROWS = 1_000_000


def is_trace(kind: str) -> bool:
    return isinstance(kind, str) and kind.startswith(TRACE_PREFIX)


def check_length_kind(kind: str) -> str:
    """A stored or named length distribution: one of RAGGED_KINDS or trace:<16 hex digits>."""
    if kind in RAGGED_KINDS:
        return kind
    if is_trace(kind):
        digest = kind[len(TRACE_PREFIX):]
        if len(digest) == 16 and all(ch in "0123456789abcdef" for ch in digest):
            return kind
    raise ProblemError(f"unknown length distribution {str(kind)[:80]!r}; one of "
                       f"{', '.join(RAGGED_KINDS)}, or a CSV file of request lengths")


def _scaled_to_mean(raw: Sequence[float], context_len: int, lo: int) -> list[int]:
    """`raw` scaled so the batch's mean length is context_len (the plugin looks a batch up by its
    mean), each clipped to [lo, 8 x context_len]: what a clip cuts off (or adds) is made up by
    rescaling the others, then the rounding remainder goes a token at a time to the largest
    fractions, so the total is exactly batch x context_len wherever the clips allow and the
    bucket's lookup statistic (vllm_metax.core.decisions.bucket_context) is its context."""
    n = len(raw)
    target = context_len * n
    hi = max(lo, min(8 * context_len, MAX_LENGTH))
    vals = [max(float(x), 0.0) for x in raw]
    fixed: dict = {}
    exact = [float(context_len)] * n
    for _ in range(n + 1):
        free = [i for i in range(n) if i not in fixed]
        rest = target - sum(fixed.values())
        total = sum(vals[i] for i in free)
        if not free or total <= 0:
            exact = [fixed.get(i, rest / max(len(free), 1)) for i in range(n)]
            break
        scale = rest / total
        clipped = {i: (hi if vals[i] * scale > hi else lo) for i in free
                   if not lo <= vals[i] * scale <= hi}
        if not clipped:
            exact = [fixed[i] if i in fixed else vals[i] * scale for i in range(n)]
            break
        fixed.update(clipped)
    out = [min(max(int(x), lo), hi) for x in exact]
    diff = target - sum(out)
    order = sorted(range(n), key=lambda i: -(exact[i] - int(exact[i])))
    step = 1 if diff > 0 else -1
    for i in order * 2:
        if diff == 0:
            break
        if lo <= out[i] + step <= hi:
            out[i] += step
            diff -= step
    return out


def ragged_lengths(kind: str, batch: int, context_len: int, q_len: int, seed: int) -> list[int]:
    """Per-request KV lengths with mean about context_len, each >= q_len: uniform (all equal),
    uniform-random (<= 2 x context_len), lognormal (median context_len/1.5, <= 4 x), zipf
    (a Zipf-like power-law tail: Lomax with exponent ZIPF_EXPONENT, median ~0.3 x the mean, mean
    exactly context_len, <= 8 x). A recorded trace
    is not a kind: its workloads carry their lengths (LengthTrace.sample)."""
    if kind == "uniform":
        return [context_len] * batch
    rng = random.Random(seed)
    lo = max(q_len, 1)
    if kind == "uniform-random":
        return [rng.randint(lo, max(lo, 2 * context_len - lo)) for _ in range(batch)]
    if kind == "zipf":
        # Lomax (Pareto II, shifted to start at 0): median 0.29 x the mean, a power-law tail
        return _scaled_to_mean([rng.paretovariate(ZIPF_EXPONENT) - 1.0 for _ in range(batch)],
                               context_len, lo)
    if kind != "lognormal":
        raise ProblemError(f"length distribution {kind!r} has no rule for its lengths")
    # lognormal with median context_len/1.5 and a long tail, clipped: how chat traffic looks
    out = []
    for _ in range(batch):
        v = int(rng.lognormvariate(math.log(max(context_len / 1.5, 1)), 0.8))
        out.append(min(max(v, lo), 4 * context_len))
    return out


@dataclass(frozen=True)
class LengthTrace:
    """Per-request lengths recorded from real traffic (`load_trace`): a bucket draws its batch
    from them (`sample`). Its identity is the digest of the lengths, in order, so two traces
    never share a workload and a reformatted copy of one file is the same trace."""

    source: str
    lengths: tuple
    digest: str

    @classmethod
    def of(cls, lengths: Sequence[int], source: str = "trace") -> "LengthTrace":
        lens = tuple(int(x) for x in lengths)
        if not lens:
            raise ProblemError(f"{source}: no request lengths")
        digest = hashlib.sha256(",".join(map(str, lens)).encode()).hexdigest()
        return cls(source, lens, digest)

    @property
    def kind(self) -> str:
        return TRACE_PREFIX + self.digest[:16]

    def sample(self, batch: int, context_len: int, q_len: int = 1, seed: int = 0) -> tuple:
        """`batch` lengths drawn from the trace with replacement (seeded), then scaled so their
        mean is the bucket's context (the statistic the plugin looks a batch up by; the trace
        gives the shape of the distribution, the bucket its size) and clipped to
        [q_len, 8 x context]."""
        rng = random.Random(seed)
        return tuple(_scaled_to_mean([rng.choice(self.lengths) for _ in range(batch)],
                                     context_len, max(q_len, 1)))


def load_trace(path) -> LengthTrace:
    """Request lengths from a CSV file: the first column among LENGTH_COLUMNS (header,
    case-insensitive), or the one column of a file without a header. Raises ProblemError with
    the file and line for anything else (missing, empty, no such column, a value that is not a
    positive integer)."""
    try:
        text = input_text(path, "request-length CSV", max_bytes=64 << 20)
    except InputError as e:
        raise ProblemError(f"cannot read request lengths: {e}") from None
    try:
        rows = [r for r in csv.reader(text.splitlines())
                if r and "".join(r).strip() and not r[0].strip().startswith("#")]
    except csv.Error as e:
        raise ProblemError(f"{path}: not a CSV file ({e})") from None
    if not rows:
        raise ProblemError(f"{path}: no request lengths (the file is empty)")

    def number(x: str) -> bool:
        return ascii_int(x) is not None

    header = [h.strip().lower() for h in rows[0]]
    if not all(number(x) for x in rows[0]):
        col = next((header.index(c) for c in LENGTH_COLUMNS if c in header), None)
        if col is None:
            raise ProblemError(f"{path}: no request-length column; the header has "
                               f"{', '.join(repr(h[:30]) for h in header[:12])}, expected one of "
                               f"{', '.join(LENGTH_COLUMNS)}")
        body, first = rows[1:], 2
    else:
        if len(rows[0]) != 1:
            raise ProblemError(f"{path}: {len(rows[0])} columns and no header: name the length "
                               f"column ({', '.join(LENGTH_COLUMNS[:4])}, ...) in a header line")
        col, body, first = 0, rows, 1
    if len(body) > MAX_TRACE_ROWS:
        raise ProblemError(f"{path}: more than {MAX_TRACE_ROWS} requests")
    lengths = []
    for i, r in enumerate(body, first):
        v = r[col].strip() if col < len(r) else ""
        if not number(v) or not 1 <= ascii_int(v) <= MAX_LENGTH:
            raise ProblemError(f"{path}:{i}: request length {v[:40]!r} is not an integer in "
                               f"1..{MAX_LENGTH}")
        lengths.append(int(v))
    if not lengths:
        raise ProblemError(f"{path}: no request lengths (a header and no rows)")
    return LengthTrace.of(lengths, str(path))


def workload_for(model: ModelDims, tp_size: int, batch_size: int, context_len: int, q_len: int = 1,
                 ragged: str = "uniform", seed: int = 0, q_dtype: str = "bfloat16",
                 kv_dtype: str = "bfloat16", trace: LengthTrace | None = None) -> Workload:
    """One bucket's workload; with `trace`, its lengths are drawn from the recorded trace (and
    `ragged` is the trace's kind)."""
    lengths = None
    if trace is not None:
        ragged = trace.kind
        lengths = trace.sample(batch_size, context_len, q_len, seed)
    return Workload(model.heads_per_rank(tp_size), model.kv_lora_rank, model.qk_rope_head_dim,
                    model.softmax_scale, batch_size, context_len, q_len, ragged, seed, q_dtype,
                    kv_dtype, model.name, lengths)


def log2_grid(lo: int, hi: int) -> list[int]:
    """Powers of two from lo to hi inclusive (lo, hi need not be powers of two)."""
    if lo < 1 or hi < lo:
        raise ProblemError(f"bad range [{lo}, {hi}]")
    out, v = [], 1
    while v < lo:
        v *= 2
    while v <= hi:
        out.append(v)
        v *= 2
    return out or [lo]


@dataclass(frozen=True)
class WorkloadMix:
    """Weights over (batch, context) buckets: what the global page-size choice minimises.

    `snap` False (a --mix CSV): every weighted key must be a measured bucket. True (a recorded
    traffic, `mla_tune.store.traffic`): the keys are observed steps (batch, context, q_len), each
    adding its weight to the measured bucket the plugin's lookup would snap it to."""

    weights: dict = field(default_factory=dict)   # (batch, context) or (batch, context, q_len) -> weight
    snap: bool = False
    source: str = ""                              # where the weights come from, for people
    # the model key the weights were observed at, (heads per rank, kv_lora_rank); None: any
    model_key: tuple | None = None

    def applies(self, num_heads: int, kv_lora_rank: int) -> bool:
        """Whether these weights are for a model entry of these dims (a recorded traffic is one
        model's; other entries of the same choice stay uniform)."""
        return self.model_key is None or tuple(self.model_key) == (num_heads, kv_lora_rank)

    def weight(self, batch: int, context: int) -> float:
        if not self.weights:
            return 1.0
        return float(self.weights.get((batch, context), 0.0))

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, int, float]], source: str = "workload mix") -> "WorkloadMix":
        w = {}
        for b, c, x in rows:
            try:
                INT["batch"].check("batch", b)
                INT["context"].check("context", c)
                FLOAT["weight"].check("weight", x)
            except InputError as e:
                raise ProblemError(f"{source}: batch {b}, context {c}, weight {x}: {e}") from None
            if (b, c) in w:
                raise ProblemError(f"{source}: batch {b}, context {c} appears twice")
            w[(int(b), int(c))] = float(x)
        if not w or sum(w.values()) <= 0:
            raise ProblemError(f"{source}: a workload mix needs at least one positive weight")
        return cls(w)

    @classmethod
    def from_file(cls, path: str) -> "WorkloadMix":
        """Read (batch, context, weight) rows from a CSV file (header optional)."""
        try:
            text = input_text(path, "workload mix CSV")
        except InputError as e:
            raise ProblemError(f"cannot read workload mix: {e}") from None
        rows = []
        try:
            for i, row in enumerate(csv.reader(text.splitlines())):
                if not row or not "".join(row).strip() or row[0].strip().startswith("#"):
                    continue
                try:
                    if len(row) != 3 or any(len(x) > 40 for x in row):
                        raise ValueError
                    rows.append((int(row[0]), int(row[1]), float(row[2])))
                except ValueError:
                    if i == 0 and not any(x.strip().lstrip("+-").replace(".", "", 1).isdigit() for x in row):
                        continue  # header
                    raise ProblemError(f"{path}:{i + 1}: expected batch,context,weight; got "
                                       f"{','.join(row)[:80]!r}") from None
        except csv.Error as e:
            raise ProblemError(f"{path}: not a CSV file ({e})") from None
        return cls.from_rows(rows, str(path))

    def check_covers(self, buckets, where: str = "the measured buckets") -> None:
        """Raise ProblemError if a weighted (batch, context) is not among `buckets`: its weight
        would silently count for nothing. A snapping mix (a recorded traffic) lands anywhere."""
        if self.snap:
            return
        missing = sorted(k for k, x in self.weights.items() if x > 0 and k not in set(buckets))
        if missing:
            shown = ", ".join(f"batch {b} context {c}" for b, c in missing[:5])
            raise ProblemError(f"workload mix weights {len(missing)} bucket(s) not in {where}: "
                               f"{shown}{' ...' if len(missing) > 5 else ''}")
