"""The tuned-config schema: one stdlib-only module shared by the writer (`mla-tune emit`) and the
reader (the vLLM plugin, at backend selection and at plan time).

A file holds one device's choices, named in vLLM's tuned-config style
(`device_name=NVIDIA_H200.json`). Per model dims (heads per rank, kv_lora_rank, rope dim, dtypes)
it records a global choice (attention-backend order, KV page size), per-bucket plan-time
choices per kernel family (FlashInfer backend; Triton num_kv_splits) and, optionally, the MLA
prefill section: per prefill bucket the FlashInfer ragged-prefill backend (fa2/fa3). A prefill
bucket is keyed by the plan's kind (causal new tokens, or a non-causal context chunk), its total
query tokens and its mean KV tokens per request (`vllm_metax.decisions.prefill_statistic`).
Configs without a prefill section stay valid: prefill then plans the device default.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_metax.log import get_logger
# Each family's knobs and their legal values: vllm_metax.choices (the one definition; the split
# kernel's facts from vllm_metax.ops.split_facts), re-exported here for the reader and mla_tune.
from vllm_metax.choices import (  # noqa: F401
    DEFAULT_SPLIT_PIPE, FLASHINFER_BACKENDS, FLASHMLA_BACKEND, FLASHMLA_PAGE_SIZE, KV_CHUNKS,
    MAX_KV_SPLITS, MAX_SPLITS, SPLIT_BACKEND, SPLIT_PARTIALS, SPLIT_PIPES, TRITON_BACKEND, ChoiceError,
)
import vllm_metax.choices as _choices

logger = get_logger(__name__)

SCHEMA_VERSION = 1
FOLDER_ENV = "VLLM_METAX_MLA_CONFIG_FOLDER"   # own variable: vLLM-metax overwrites VLLM_TUNED_CONFIG_FOLDER
STRICT_ENV = "VLLM_METAX_MLA_CONFIG_STRICT"
PACKAGED_ENV = "VLLM_METAX_MLA_PACKAGED_FOLDER"   # tests only: stand-in for the shipped folder
PACKAGED_FOLDER = Path(os.environ.get(PACKAGED_ENV) or Path(__file__).resolve().parent / "configs")
ATTENTION_BACKENDS = ("FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA")
FAMILIES = tuple(_choices.KNOBS)   # flashinfer, triton, flashmla, split

# What a value may be, for the reader here and for every mla-tune input (mla_tune/validate.py uses
# these same bounds): a value outside them is refused, never clamped.
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # KV block sizes: powers of two up to vLLM's largest
# FlashInfer ragged-prefill backend values a prefill bucket may name (the plugin plans prefill with
# fa2 or fa3 only; "auto" is FlashInfer's policy, never a tuned value).
PREFILL_BACKENDS = ("fa2", "fa3")
MAX_BATCH = 65536              # requests in one decode step
MAX_CONTEXT = 1 << 22          # KV tokens per request (4M; DeepSeek-V3 serves 160K)
MAX_PREFILL_TOKENS = 1 << 22   # query / KV tokens of one prefill plan
MAX_Q_LEN = 1024               # query tokens per request in one step (speculative decode)
MAX_HEADS = 1024               # attention heads per rank
MAX_HEAD_DIM = 4096            # kv_lora_rank, qk_rope_head_dim
DTYPES = ("bfloat16", "float16")
MAX_NAME = 200                 # device and model names: characters
MAX_CONFIG_BYTES = 64 << 20    # a tuned config is ~60 KB; anything near this is not one
MAX_JSON_DEPTH = 64


class TunedConfigError(ValueError):
    """A tuned-config file that cannot be used; the message names the file and the problem."""


def check_device_name(name, where: str = "device name") -> str:
    """A device name as vLLM and file names use it: printable, no path separators, bounded."""
    if not isinstance(name, str):
        raise TunedConfigError(f"{where} should be a string, got {type(name).__name__}")
    n = name.strip()
    if not n or len(n) > MAX_NAME or not n.isprintable() or any(ch in n for ch in "/\\") \
            or n in (".", "..") or n.startswith("."):
        raise TunedConfigError(f"{where} {name[:80]!r} is not a device name (1-{MAX_NAME} printable "
                               "characters, no path separators, not starting with '.')")
    return name


def config_filename(device_name: str) -> str:
    check_device_name(device_name)
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
        q = q_len if q_len in self._grid else _nearest(sorted(self._grid), q_len)
        batches, per_batch = self._grid[q]
        b = _nearest(batches, batch_size)
        contexts, cells = per_batch[b]
        c = _nearest(contexts, context_len)
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
        q = _nearest(qs, query_tokens)
        ks, cells = per_q[q]
        return cells[_nearest(ks, kv_len)]


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
                    **({"prefill": {"buckets": [
                        {"causal": p.causal, "query_tokens": p.query_tokens, "kv_len": p.kv_len,
                         "params": p.params, "time_us": p.time_us,
                         "default_time_us": p.default_time_us, "significant": p.significant}
                        for p in m.prefill]}} if m.prefill else {}),
                }
                for m in self.models
            ],
        }


# ---------------------------------------------------------------- parsing and validation

def _type_name(v) -> str:
    return "null" if v is None else type(v).__name__


def _need(d: dict, key: str, typ, where: str):
    if not isinstance(d, dict):
        raise TunedConfigError(f"{where}: should be an object, got {_type_name(d)}")
    if key not in d:
        raise TunedConfigError(f"{where}: missing field {key!r}")
    v = d[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise TunedConfigError(f"{where}: field {key!r} should be {typ.__name__}, got {_type_name(v)}")
    return v


def _int_in(d: dict, key: str, lo: int, hi: int, where: str) -> int:
    v = _need(d, key, int, where)
    if not lo <= v <= hi:
        shown = v if abs(v) < 10 ** 12 else f"a {len(str(abs(v)))}-digit number"
        raise TunedConfigError(f"{where}: field {key!r} must be in {lo}..{hi}, got {shown}")
    return v


def _opt_float(d: dict, key: str, where: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise TunedConfigError(f"{where}: field {key!r} should be a positive number, got {v!r}")
    return float(v)


def _opt_str(d: dict, key: str, where: str, default=None):
    v = d.get(key, default)
    if v is not None and not isinstance(v, str):
        raise TunedConfigError(f"{where}: field {key!r} should be a string, got {_type_name(v)}")
    return v


def _bool(d: dict, key: str, where: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise TunedConfigError(f"{where}: field {key!r} should be true or false, got {_type_name(v)}")
    return v


def check_page_size(v, where: str = "page_size") -> int:
    """A KV page (vLLM block) size: one of PAGE_SIZES."""
    if isinstance(v, bool) or not isinstance(v, int) or v not in PAGE_SIZES:
        shown = v if not isinstance(v, int) or abs(v) < 10 ** 12 else f"a {len(str(abs(v)))}-digit number"
        raise TunedConfigError(f"{where} must be one of {', '.join(map(str, PAGE_SIZES))}, got {shown!r}")
    return v


def check_params(family: str, params: dict, where: str) -> dict:
    """A family's plan-time parameters: known keys with known values only
    (`vllm_metax.choices.check_params`, the one definition)."""
    try:
        _choices.check_params(family, params, where)
    except ChoiceError as e:
        raise TunedConfigError(str(e)) from None
    return params


def _dims(d: dict, where: str) -> ModelDims:
    dtypes = []
    for k in ("q_dtype", "kv_dtype"):
        v = d.get(k, "bfloat16")
        if v not in DTYPES:
            raise TunedConfigError(f"{where}: {k} must be one of {', '.join(DTYPES)}, got {v!r}")
        dtypes.append(v)
    return ModelDims(_int_in(d, "num_heads", 1, MAX_HEADS, where),
                     _int_in(d, "kv_lora_rank", 1, MAX_HEAD_DIM, where),
                     _int_in(d, "qk_rope_head_dim", 1, MAX_HEAD_DIM, where), *dtypes)


def _bucket(b, bw: str) -> Bucket:
    fams = {}
    for fam, c in _need(b, "families", dict, bw).items():
        if fam not in FAMILIES:
            raise TunedConfigError(f"{bw}: unknown kernel family {fam!r} (known: {', '.join(FAMILIES)})")
        fw = f"{bw}.families.{fam}"
        params = check_params(fam, _need(c, "params", dict, fw), fw)
        fams[fam] = FamilyChoice(params, _opt_float(c, "time_us", fw),
                                 _opt_float(c, "default_time_us", fw), _bool(c, "significant", fw))
    bs = _int_in(b, "batch_size", 1, MAX_BATCH, bw)
    cl = _int_in(b, "context_len", 1, MAX_CONTEXT, bw)
    ql = _int_in(b, "q_len", 1, MAX_Q_LEN, bw)
    if ql > cl:
        raise TunedConfigError(f"{bw}: q_len {ql} is longer than context_len {cl}")
    best = b.get("best_family")
    if best is not None and (not isinstance(best, str) or best not in fams):
        raise TunedConfigError(f"{bw}: best_family {best!r} is not one of the bucket's families "
                               f"({', '.join(fams) or 'none'})")
    return Bucket(bs, cl, ql, fams, best)


def check_prefill_params(params, where: str) -> dict:
    """A prefill bucket's parameters: {"backend": one of PREFILL_BACKENDS}, nothing else."""
    if not isinstance(params, dict):
        raise TunedConfigError(f"{where}: params should be an object, got {_type_name(params)}")
    if params.get("backend") not in PREFILL_BACKENDS:
        shown = params.get("backend")
        raise TunedConfigError(f"{where}: params.backend must be one of "
                               f"{', '.join(PREFILL_BACKENDS)} (the FlashInfer ragged-prefill "
                               f"backends the plugin plans), got {str(shown)[:80]!r}")
    unknown = sorted(set(params) - {"backend"})
    if unknown:
        raise TunedConfigError(f"{where}: unknown prefill parameter {', '.join(map(repr, unknown))} "
                               "(known: backend)")
    return params


def _prefill(section, where: str) -> list:
    raw = _need(section, "buckets", list, where)
    out, seen = [], set()
    for j, b in enumerate(raw):
        bw = f"{where}.buckets[{j}]"
        causal = _need(b, "causal", bool, bw)
        q = _int_in(b, "query_tokens", 1, MAX_PREFILL_TOKENS, bw)
        kv = _int_in(b, "kv_len", 1, MAX_PREFILL_TOKENS, bw)
        if causal and kv > q:
            raise TunedConfigError(f"{bw}: a causal (new-token) bucket's kv_len {kv} is more than "
                                   f"its query_tokens {q} (each request attends to its own tokens)")
        params = check_prefill_params(_need(b, "params", dict, bw), bw)
        key = (causal, q, kv)
        if key in seen:
            raise TunedConfigError(f"{bw}: prefill bucket causal={causal}, query_tokens {q}, "
                                   f"kv_len {kv} appears twice")
        seen.add(key)
        out.append(PrefillBucket(causal, q, kv, params, _opt_float(b, "time_us", bw),
                                 _opt_float(b, "default_time_us", bw), _bool(b, "significant", bw)))
    return out


def _entry(m, where: str) -> ModelEntry:
    dims = _dims(_need(m, "dims", dict, where), where + ".dims")
    g = _need(m, "global", dict, where)
    page_size = check_page_size(_need(g, "page_size", int, where + ".global"), where + ".global: page_size")
    order = _need(g, "backend_order", list, where + ".global")
    unknown = [b for b in order if not isinstance(b, str) or b not in ATTENTION_BACKENDS]
    if not order or unknown or len(set(order)) != len(order):
        raise TunedConfigError(f"{where}.global: backend_order must list some of "
                               f"{ATTENTION_BACKENDS} once each, got {str(order)[:200]}")
    raw = _need(m, "buckets", list, where)
    if not raw:
        raise TunedConfigError(f"{where}: buckets is empty (an entry without buckets tunes nothing)")
    buckets, seen = [], set()
    for j, b in enumerate(raw):
        bucket = _bucket(b, f"{where}.buckets[{j}]")
        key = (bucket.batch_size, bucket.context_len, bucket.q_len)
        if key in seen:
            raise TunedConfigError(f"{where}.buckets[{j}]: bucket batch {key[0]}, context {key[1]}, "
                                   f"q_len {key[2]} appears twice")
        seen.add(key)
        buckets.append(bucket)
    tp = m.get("tp_size")
    if tp is not None:
        tp = _int_in(m, "tp_size", 1, MAX_HEADS, where)
    model = _opt_str(m, "model", where)
    if model is not None and (not model.strip() or len(model) > MAX_NAME):
        raise TunedConfigError(f"{where}: model must be 1-{MAX_NAME} characters, got {model[:80]!r}")
    prefill = _prefill(m["prefill"], where + ".prefill") if m.get("prefill") is not None else []
    return ModelEntry(dims, page_size, order, buckets, model, tp, _opt_str(g, "reason", where, ""),
                      prefill)


def parse_tuned_config(data, source: str = "<config>") -> TunedConfig:
    """Validate a decoded JSON document; raise TunedConfigError with one clear message."""
    if not isinstance(data, dict):
        raise TunedConfigError(f"{source}: top level must be a JSON object")
    version = _need(data, "schema_version", int, source)
    if version != SCHEMA_VERSION:
        shown = version if abs(version) < 10 ** 12 else "a huge number"
        raise TunedConfigError(
            f"{source}: schema_version {shown} is not supported (this reader knows {SCHEMA_VERSION})")
    device = check_device_name(_need(data, "device_name", str, source), f"{source}: device_name")
    provenance = _need(data, "provenance", dict, source)
    models, seen = [], set()
    entries = _need(data, "models", list, source)
    if not entries:
        raise TunedConfigError(f"{source}: models is empty; a tuned config holds at least one "
                               "model entry")
    for i, m in enumerate(entries):
        entry = _entry(m, f"{source}: models[{i}]")
        if entry.dims in seen:
            raise TunedConfigError(f"{source}: models[{i}]: a second entry for the same dims")
        seen.add(entry.dims)
        models.append(entry)
    return TunedConfig(device, provenance, models, version)


def read_text_file(path: str | os.PathLike, max_bytes: int, what: str = "file",
                   error: type = TunedConfigError) -> str:
    """The UTF-8 text of a regular file of at most max_bytes; anything else raises `error`."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{p}: is a folder, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{p}: is not a regular file (a device, pipe or socket), not a {what}")
    if st.st_size > max_bytes:
        raise error(f"{p}: {st.st_size} bytes is too large for a {what} (at most {max_bytes})")
    try:
        with open(p, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise error(f"{p}: too large for a {what} (at most {max_bytes} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start}), so not a {what}") from None
    if "\x00" in text:
        raise error(f"{p}: holds NUL bytes, so not a {what}")
    return text


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def _json_depth_ok(text: str, limit: int) -> bool:
    """Whether JSON text nests at most `limit` levels (strings skipped; checked before parsing
    so that no depth can reach the decoder's or the renderers' recursion limits)."""
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def read_tuned_config(path: str | os.PathLike) -> TunedConfig:
    """Read and validate one file; any problem with it raises TunedConfigError, nothing else."""
    p = Path(path)
    text = read_text_file(p, MAX_CONFIG_BYTES, "tuned config")
    if not _json_depth_ok(text, MAX_JSON_DEPTH):
        raise TunedConfigError(f"{p}: JSON nested deeper than {MAX_JSON_DEPTH} levels, not a tuned config")
    try:
        data = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise TunedConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (ValueError, RecursionError) as e:   # ints past Python's digit limit, NaN/Infinity
        raise TunedConfigError(f"{p}: not a tuned config ({str(e).splitlines()[0][:120]})") from None
    try:
        cfg = parse_tuned_config(data, str(p))
    except TunedConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
        # a shape the checks above did not foresee is still the file's fault, not the reader's
        raise TunedConfigError(f"{p}: not a tuned config ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    cfg.path = str(p)
    return cfg


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: an object naming one key twice is refused (json's default keeps
    the last, so `"page_size": 64, "page_size": 16` would silently read as 16)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k[:60]!r} appears twice in one object")
        out[k] = v
    return out


def creatable_folder(folder: str | os.PathLike, named: bool = True) -> str | None:
    """Why `folder` cannot be made or written into, or None. A folder the user named is made when
    its parent exists; missing folders above it only inside the working directory (never
    implicitly elsewhere, e.g. at the filesystem root). `named=False`: the folder is the parent of
    a named file, so it too is made only inside the working directory."""
    f = Path(folder)
    if f.exists() and not f.is_dir():
        return f"{f} exists and is not a folder"
    if f.is_dir():
        return None if os.access(f, os.W_OK | os.X_OK) else f"{f} is not writable"
    cwd = Path.cwd().resolve()
    target = f.resolve() if f.is_absolute() else (cwd / f).resolve()
    inside = cwd == target or cwd in target.parents
    if not inside and not (named and target.parent.is_dir()):
        return (f"folder {target.parent if named else target} does not exist and is outside the "
                "working directory: create it first (mla-tune makes missing folders only below the "
                "working directory)")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder, so {f} cannot be made"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"


def is_own_config(path: str | os.PathLike) -> bool:
    """Whether an existing file is a tuned config (what the writer may replace)."""
    try:
        data = json.loads(read_text_file(path, MAX_CONFIG_BYTES, "tuned config"))
    except (TunedConfigError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "schema_version" in data and "device_name" in data


def check_config_target(cfg_device: str, folder: str | os.PathLike) -> Path:
    """Where write_tuned_config would write, refused (TunedConfigError) when it must not: a folder
    it may not make, or a file there that is not a tuned config."""
    why = creatable_folder(folder)
    if why:
        raise TunedConfigError(why)
    path = Path(folder) / config_filename(cfg_device)
    if os.path.lexists(path) and (not path.is_file() or path.is_symlink() or not is_own_config(path)):
        raise TunedConfigError(f"{path} exists and is not a tuned config; left untouched "
                               "(move it away or write elsewhere)")
    return path


def write_tuned_config(cfg: TunedConfig, folder: str | os.PathLike) -> Path:
    """Write atomically to folder/device_name=<name>.json (validated by a round trip first)."""
    data = cfg.to_json()
    parse_tuned_config(json.loads(json.dumps(data)), "<new config>")
    path = check_config_target(cfg.device_name, folder)
    tmp = path.with_suffix(".json.tmp")
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise TunedConfigError(f"cannot write {path}: {e.strerror or e}") from None
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
    """Find, read and validate this device's file. Never raises unless strict mode is on.

    A file (or anything else) named like the config that cannot be used is reported, not skipped;
    strict mode raises for it, the lenient mode returns no config and says why."""
    try:
        name = config_filename(device_name)
    except TunedConfigError as e:
        if strict_mode():
            raise
        return Resolution(None, None, f"ignored (using defaults): {e}")
    tried = []
    for folder, why in search_folders():
        path = folder / name
        tried.append(str(path))
        if not os.path.lexists(path):
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
