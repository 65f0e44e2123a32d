"""The tuned-config schema: one stdlib-only module shared by the writer (`mla-tune emit`) and the
reader (the vLLM plugin, at backend selection and at plan time).

A file holds one device's choices, named in vLLM's tuned-config style
(`device_name=NVIDIA_H200.json`). Per model dims (heads per rank, kv_lora_rank, rope dim, dtypes)
it records a global choice (attention-backend order, KV page size) and per-bucket plan-time
choices per kernel family (FlashInfer backend; Triton num_kv_splits).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FOLDER_ENV = "VLLM_METAX_MLA_CONFIG_FOLDER"   # own variable: vLLM-metax overwrites VLLM_TUNED_CONFIG_FOLDER
STRICT_ENV = "VLLM_METAX_MLA_CONFIG_STRICT"
PACKAGED_ENV = "VLLM_METAX_MLA_PACKAGED_FOLDER"   # tests only: stand-in for the shipped folder
PACKAGED_FOLDER = Path(os.environ.get(PACKAGED_ENV) or Path(__file__).resolve().parent / "configs")
ATTENTION_BACKENDS = ("FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA")
FAMILIES = ("flashinfer", "triton")


class TunedConfigError(ValueError):
    """A tuned-config file that cannot be used; the message names the file and the problem."""


def config_filename(device_name: str) -> str:
    return f"device_name={device_name.strip().replace(' ', '_')}.json"


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
        if self.time_us and self.default_time_us:
            return self.default_time_us / self.time_us
        return None


@dataclass(frozen=True)
class Bucket:
    batch_size: int
    context_len: int
    q_len: int
    families: dict                     # family -> FamilyChoice
    best_family: str | None = None


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
    _grid: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
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
        q = q_len if q_len in self._grid else _nearest(sorted(self._grid), q_len)
        batches, per_batch = self._grid[q]
        b = _nearest(batches, batch_size)
        contexts, cells = per_batch[b]
        c = _nearest(contexts, context_len)
        in_range = (batches[0] <= batch_size <= batches[-1] and contexts[0] <= context_len <= contexts[-1])
        exact = q == q_len and b == batch_size and c == context_len
        return Lookup(cells[c], exact, in_range)


def _nearest(sorted_keys: list, value: int) -> int:
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

    def entry_for(self, dims: ModelDims) -> ModelEntry | None:
        for m in self.models:
            if m.dims == dims:
                return m
        return None

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
                }
                for m in self.models
            ],
        }


# ---------------------------------------------------------------- parsing and validation

def _need(d: dict, key: str, typ, where: str):
    if not isinstance(d, dict) or key not in d:
        raise TunedConfigError(f"{where}: missing field {key!r}")
    v = d[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise TunedConfigError(f"{where}: field {key!r} should be {typ.__name__}, got {type(v).__name__}")
    return v


def _opt_float(d: dict, key: str, where: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise TunedConfigError(f"{where}: field {key!r} should be a positive number, got {v!r}")
    return float(v)


def parse_tuned_config(data, source: str = "<config>") -> TunedConfig:
    """Validate a decoded JSON document; raise TunedConfigError with one clear message."""
    if not isinstance(data, dict):
        raise TunedConfigError(f"{source}: top level must be a JSON object")
    version = _need(data, "schema_version", int, source)
    if version != SCHEMA_VERSION:
        raise TunedConfigError(
            f"{source}: schema_version {version} is not supported (this reader knows {SCHEMA_VERSION})")
    device = _need(data, "device_name", str, source)
    provenance = _need(data, "provenance", dict, source)
    models = []
    for i, m in enumerate(_need(data, "models", list, source)):
        where = f"{source}: models[{i}]"
        d = _need(m, "dims", dict, where)
        try:
            dims = ModelDims(_need(d, "num_heads", int, where), _need(d, "kv_lora_rank", int, where),
                             _need(d, "qk_rope_head_dim", int, where),
                             d.get("q_dtype", "bfloat16"), d.get("kv_dtype", "bfloat16"))
        except TypeError as e:
            raise TunedConfigError(f"{where}: bad dims: {e}") from None
        g = _need(m, "global", dict, where)
        page_size = _need(g, "page_size", int, where + ".global")
        if page_size < 1:
            raise TunedConfigError(f"{where}.global: page_size must be positive, got {page_size}")
        order = _need(g, "backend_order", list, where + ".global")
        unknown = [b for b in order if b not in ATTENTION_BACKENDS]
        if not order or unknown:
            raise TunedConfigError(
                f"{where}.global: backend_order must list some of {ATTENTION_BACKENDS}, got {order}")
        buckets = []
        for j, b in enumerate(_need(m, "buckets", list, where)):
            bw = f"{where}.buckets[{j}]"
            fams = {}
            for fam, c in _need(b, "families", dict, bw).items():
                if fam not in FAMILIES:
                    raise TunedConfigError(f"{bw}: unknown kernel family {fam!r}")
                fw = f"{bw}.families.{fam}"
                fams[fam] = FamilyChoice(_need(c, "params", dict, fw), _opt_float(c, "time_us", fw),
                                         _opt_float(c, "default_time_us", fw),
                                         bool(c.get("significant", False)))
            bs, cl, ql = (_need(b, k, int, bw) for k in ("batch_size", "context_len", "q_len"))
            if min(bs, cl, ql) < 1:
                raise TunedConfigError(f"{bw}: batch_size, context_len and q_len must be positive")
            buckets.append(Bucket(bs, cl, ql, fams, b.get("best_family")))
        models.append(ModelEntry(dims, page_size, order, buckets, m.get("model"), m.get("tp_size"),
                                 g.get("reason", "")))
    return TunedConfig(device, provenance, models, version)


def read_tuned_config(path: str | os.PathLike) -> TunedConfig:
    """Read and validate one file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TunedConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TunedConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    cfg = parse_tuned_config(data, str(p))
    cfg.path = str(p)
    return cfg


def write_tuned_config(cfg: TunedConfig, folder: str | os.PathLike) -> Path:
    """Write atomically to folder/device_name=<name>.json (validated by a round trip first)."""
    data = cfg.to_json()
    parse_tuned_config(json.loads(json.dumps(data)), "<new config>")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / config_filename(cfg.device_name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- discovery for the plugin

def search_folders() -> list[tuple[Path, str]]:
    """Where the plugin looks, in order, with why."""
    out = []
    if os.environ.get(FOLDER_ENV):
        out.append((Path(os.environ[FOLDER_ENV]), f"${FOLDER_ENV}"))
    out.append((PACKAGED_FOLDER, "packaged configs/"))
    return out


@dataclass(frozen=True)
class Resolution:
    """What the plugin would load for a device, and why (shown by `mla-tune doctor`)."""

    config: TunedConfig | None
    path: Path | None
    reason: str


def strict_mode() -> bool:
    return os.environ.get(STRICT_ENV, "").lower() in ("1", "true", "yes")


def resolve_tuned_config(device_name: str) -> Resolution:
    """Find, read and validate this device's file. Never raises unless strict mode is on."""
    name = config_filename(device_name)
    tried = []
    for folder, why in search_folders():
        path = folder / name
        tried.append(str(path))
        if not path.is_file():
            continue
        try:
            cfg = read_tuned_config(path)
        except TunedConfigError as e:
            if strict_mode():
                raise
            return Resolution(None, path, f"ignored (using defaults): {e}")
        if cfg.device_name.replace(" ", "_") != device_name.strip().replace(" ", "_"):
            msg = f"{path}: written for device {cfg.device_name!r}, this is {device_name!r}"
            if strict_mode():
                raise TunedConfigError(msg)
            return Resolution(None, path, f"ignored (using defaults): {msg}")
        return Resolution(cfg, path, f"found in {why}")
    return Resolution(None, None, f"no tuned config for {device_name!r} (looked for {', '.join(tried)})")


_CACHE: dict = {}


def load_tuned_config(device_name: str) -> TunedConfig | None:
    """Cached per device for the life of the process; a miss or a bad file logs one warning."""
    if device_name in _CACHE:
        return _CACHE[device_name]
    res = resolve_tuned_config(device_name)
    if res.config is None:
        logger.warning("vllm_metax MLA: %s", res.reason)
    else:
        logger.info("vllm_metax MLA: tuned config %s (%s)", res.path, res.reason)
    _CACHE[device_name] = res.config
    return res.config


def clear_cache() -> None:
    _CACHE.clear()
