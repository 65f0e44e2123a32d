"""Reading a decoded tuned-config document: every field checked against the schema's bounds,
one clear TunedConfigError naming the file, the field and the problem (values are refused,
never clamped)."""

from __future__ import annotations

import math

from vllm_metax.core import choices
from vllm_metax.core.tuned_config.schema import (
    ATTENTION_BACKENDS, DTYPES, FAMILIES, MAX_BATCH, MAX_CONTEXT, MAX_HEAD_DIM, MAX_HEADS, MAX_NAME,
    MAX_PREFILL_TOKENS, MAX_Q_LEN, PAGE_SIZES, PREFILL_BACKENDS, SCHEMA_VERSION, Bucket, FamilyChoice,
    ModelDims, ModelEntry, PrefillBucket, TunedConfig, TunedConfigError,
)


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
    (`vllm_metax.core.choices.check_params`, the one definition)."""
    try:
        choices.check_params(family, params, where)
    except choices.ChoiceError as e:
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
                               f"{', '.join(PREFILL_BACKENDS)} (the MLA prefill "
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
                               f"{', '.join(sorted(ATTENTION_BACKENDS))} once each, got {str(order)[:200]}")
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
