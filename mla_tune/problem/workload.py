"""The MLA problem model: model dimensions (from published config.json files), workloads, buckets."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Sequence

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
    from vllm_metax.tuned_config import MAX_HEAD_DIM, MAX_HEADS
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

    def __post_init__(self):
        from mla_tune.validate import INT, MAX_KV_TOKENS
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
        if self.ragged not in RAGGED_KINDS:
            raise ProblemError(f"unknown length distribution {self.ragged!r}; one of {RAGGED_KINDS}")
        for d in (self.q_dtype, self.kv_dtype):
            if d not in DTYPES:
                raise ProblemError(f"unsupported dtype {d!r}; one of {DTYPES}")

    @property
    def seq_lens(self) -> list[int]:
        return ragged_lengths(self.ragged, self.batch_size, self.context_len, self.q_len, self.seed)

    @property
    def total_kv_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def key(self) -> dict:
        """The columns that identify this workload in the results store."""
        return asdict(self)

    def label(self) -> str:
        r = "" if self.ragged == "uniform" else f" {self.ragged}"
        q = "" if self.q_len == 1 else f" q{self.q_len}"
        return f"H{self.num_heads} B{self.batch_size} L{self.context_len}{q}{r}"


RAGGED_KINDS = ("uniform", "uniform-random", "lognormal")


def ragged_lengths(kind: str, batch: int, context_len: int, q_len: int, seed: int) -> list[int]:
    """Per-request KV lengths with mean about context_len (each >= q_len, <= 2*context_len)."""
    if kind == "uniform":
        return [context_len] * batch
    rng = random.Random(seed)
    lo = max(q_len, 1)
    if kind == "uniform-random":
        return [rng.randint(lo, max(lo, 2 * context_len - lo)) for _ in range(batch)]
    # lognormal with median context_len/1.5 and a long tail, clipped: how chat traffic looks
    out = []
    for _ in range(batch):
        v = int(rng.lognormvariate(math.log(max(context_len / 1.5, 1)), 0.8))
        out.append(min(max(v, lo), 4 * context_len))
    return out


def workload_for(model: ModelDims, tp_size: int, batch_size: int, context_len: int, q_len: int = 1,
                 ragged: str = "uniform", seed: int = 0, q_dtype: str = "bfloat16",
                 kv_dtype: str = "bfloat16") -> Workload:
    return Workload(model.heads_per_rank(tp_size), model.kv_lora_rank, model.qk_rope_head_dim,
                    model.softmax_scale, batch_size, context_len, q_len, ragged, seed, q_dtype,
                    kv_dtype, model.name)


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
    """Weights over (batch, context) buckets: what the global page-size choice minimises."""

    weights: dict = field(default_factory=dict)   # (batch, context) -> weight

    def weight(self, batch: int, context: int) -> float:
        if not self.weights:
            return 1.0
        return float(self.weights.get((batch, context), 0.0))

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, int, float]], source: str = "workload mix") -> "WorkloadMix":
        from mla_tune.validate import FLOAT, INT, InputError
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
        import csv
        from mla_tune.validate import InputError, input_text
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
        would silently count for nothing."""
        missing = sorted(k for k, x in self.weights.items() if x > 0 and k not in set(buckets))
        if missing:
            shown = ", ".join(f"batch {b} context {c}" for b, c in missing[:5])
            raise ProblemError(f"workload mix weights {len(missing)} bucket(s) not in {where}: "
                               f"{shown}{' ...' if len(missing) > 5 else ''}")
