"""`mla-tune show`: a tuned config as the plugin reads it, for people (tables, JSON, CSV, markdown),
and the check that a file belongs to the device it is inspected for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mla_tune.store.selection import device_key
from mla_tune.views.render import Column, OutputFormat, Table, render, times, to_csv


def parse_lookup(text: str) -> tuple[int, int, int]:
    """`--lookup BATCH,CONTEXT[,Q_LEN]` -> (batch, context, q_len); InputError when malformed."""
    from mla_tune.validate import InputError, ascii_int, check_int
    parts = text.split(",")
    if len(parts) not in (2, 3) or any(ascii_int(p, 19) is None for p in parts):
        raise InputError(f"--lookup takes BATCH,CONTEXT[,Q_LEN] as positive integers, got {text!r}")
    vals = [check_int(k, int(p), "--lookup " + k.replace("_", " "))
            for k, p in zip(("batch", "context", "q_len"), parts)]
    return (vals[0], vals[1], vals[2] if len(vals) == 3 else 1)


def check_config_device(cfg, path, device: str | None = None) -> None:
    """Raise TunedConfigError if the file belongs to another device than its name, `device`, or
    (without `device`) this machine's accelerator; a machine without one checks the name only."""
    from vllm_metax.tuned_config import TunedConfigError
    name = Path(path).name
    if name.startswith("device_name=") and name.endswith(".json") and \
            device_key(name[len("device_name="):-len(".json")]) != device_key(cfg.device_name):
        raise TunedConfigError(f"{path}: the file name says {name[12:-5]!r} but it was written for "
                               f"device {cfg.device_name!r}; the plugin would ignore it")
    where = "--device"
    if device is None:
        from vllm_metax.device import detect_device
        dev = detect_device()
        if dev.source == "none":
            return
        device, where = dev.name, "this machine"
    if device_key(device) != device_key(cfg.device_name):
        raise TunedConfigError(f"{path}: written for device {cfg.device_name!r}, not {device!r} "
                               f"({where}); pass --device {cfg.device_name!r} to inspect it anyway")


def _dims_title(e) -> str:
    d = e.dims
    dt = d.q_dtype if d.q_dtype == d.kv_dtype else f"{d.q_dtype}/{d.kv_dtype}"
    who = f"{e.model}{f' tp{e.tp_size}' if e.tp_size else ''} " if e.model else ""
    return f"{who}H{d.num_heads} (R{d.kv_lora_rank} P{d.qk_rope_head_dim} {dt})"


def _params_text(p: dict, family: str = "") -> str:
    """{"backend": "fa3"} -> "fa3"; {"backend": "triton", "num_kv_splits": 16} -> "num_kv_splits=16"."""
    backend = p.get("backend")
    knobs = [f"{k}={v}" for k, v in p.items() if k not in ("backend", "rule")]
    head = [str(backend)] if backend is not None and backend != family else []
    return ", ".join(head + knobs) or "-"


CONFIG_BUCKET_COLUMNS = [Column("batch"), Column("context"), Column("q"),
                         Column("family", justify="left"), Column("params", justify="left"),
                         Column("time us", ".2f"), Column("default us", ".2f"),
                         Column("gain", times), Column("significant"), Column("best", justify="left")]


def config_tables(cfg, lookup: tuple | None = None) -> list[Table]:
    """A tuned config as tables: provenance, the global choice per model, its buckets; with
    `lookup` = (batch, context, q_len), the bucket each model entry would serve it from."""
    title = f"{cfg.device_name} (schema {cfg.schema_version})"
    t = Table(f"{title}: provenance", [Column("field", justify="left"),
                                       Column("value", justify="left")])
    for k, v in cfg.provenance.items():
        flat = isinstance(v, list) and all(not isinstance(x, (list, dict)) for x in v)
        t.add(k, ", ".join(map(str, v)) if flat else v)
    tables = [t]
    g = Table(f"{title}: global choice per model", [Column("model entry", justify="left"),
              Column("page size"), Column("backend order", justify="left"),
              Column("buckets"), Column("why", justify="left")])
    for e in cfg.models:
        g.add(_dims_title(e), e.page_size, " > ".join(e.backend_order), len(e.buckets), e.reason)
    tables.append(g)
    for e in cfg.models:
        b = Table(f"{title} · {_dims_title(e)}: per-bucket plan choices", CONFIG_BUCKET_COLUMNS)
        for bk in sorted(e.buckets, key=lambda x: (x.q_len, x.batch_size, x.context_len)):
            fams = sorted(bk.families, key=lambda f: (f != bk.best_family, f))
            if not fams:
                b.add(bk.batch_size, bk.context_len, bk.q_len, None, None, None, None, None, None, "")
            for f in fams:
                c = bk.families[f]
                b.add(bk.batch_size, bk.context_len, bk.q_len, f, _params_text(c.params, f),
                      c.time_us, c.default_time_us, c.gain, c.significant,
                      "best" if f == bk.best_family else "")
        tables.append(b)
        if e.prefill:
            pt = Table(f"{title} · {_dims_title(e)}: MLA prefill backend per plan",
                       [Column("plan", justify="left"), Column("query tokens"),
                        Column("kv per request"), Column("backend", justify="left"),
                        Column("time us", ".2f"), Column("default us", ".2f"),
                        Column("gain", times), Column("significant")])
            for p in e.prefill:
                gain = p.default_time_us / p.time_us if p.time_us and p.default_time_us else None
                pt.add("new tokens" if p.causal else "context chunk", p.query_tokens, p.kv_len,
                       p.backend, p.time_us, p.default_time_us, gain, p.significant)
            tables.append(pt)
    if lookup is not None:
        batch, context, q_len = lookup
        lt = Table(f"{title}: lookup of batch {batch}, context {context}, q_len {q_len}",
                   [Column("model entry", justify="left"), Column("bucket", justify="left"),
                    Column("exact"), Column("in tuned range"), Column("choices", justify="left")])
        for e in cfg.models:
            hit = e.lookup(batch, context, q_len)
            if hit is None:
                lt.add(_dims_title(e), "no buckets", False, False, "")
                continue
            bk = hit.bucket
            choices = "; ".join(f"{f}: {_params_text(c.params, f)}" for f, c in bk.families.items())
            lt.add(_dims_title(e), f"B{bk.batch_size} L{bk.context_len} q{bk.q_len}", hit.exact,
                   hit.in_range, choices)
        tables.append(lt)
    return tables


def config_csv(cfg) -> str:
    """One CSV row per (model entry, bucket, family) with raw values."""
    cols = ["device_name", "model", "tp_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim",
            "q_dtype", "kv_dtype", "page_size", "backend_order", "batch_size", "context_len",
            "q_len", "family", "params", "time_us", "default_time_us", "gain", "significant",
            "best_family"]
    t = Table("buckets", [Column(c) for c in cols])
    for e in cfg.models:
        d = e.dims
        for bk in e.buckets:
            for f, c in bk.families.items():
                t.add(cfg.device_name, e.model, e.tp_size, d.num_heads, d.kv_lora_rank,
                      d.qk_rope_head_dim, d.q_dtype, d.kv_dtype, e.page_size,
                      " > ".join(e.backend_order), bk.batch_size, bk.context_len, bk.q_len, f,
                      c.params, c.time_us, c.default_time_us, c.gain, int(c.significant),
                      bk.best_family)
    return to_csv(t)


def render_config(cfg, fmt: str | OutputFormat, lookup: tuple | None = None) -> str | list:
    """A tuned config in a read format (table -> rich renderables, others -> text)."""
    return render(fmt, lambda: config_tables(cfg, lookup),
                  f"tuned config {cfg.path or ''}".strip(), lambda: config_json(cfg, lookup),
                  lambda: config_csv(cfg))


def config_json(cfg, lookup: tuple | None = None) -> dict:
    """The config as the file holds it; with `lookup`, the bucket each model entry serves it from."""
    data = cfg.to_json()
    if lookup is not None:
        batch, context, q_len = lookup
        data["lookup"] = []
        for e in cfg.models:
            hit = e.lookup(batch, context, q_len)
            data["lookup"].append({
                "dims": dataclasses.asdict(e.dims), "request": list(lookup),
                "bucket": None if hit is None else [hit.bucket.batch_size, hit.bucket.context_len,
                                                    hit.bucket.q_len],
                "exact": bool(hit and hit.exact), "in_range": bool(hit and hit.in_range)})
    return data
