"""`mla-tune show`: a tuned config as the plugin reads it, for people (tables, JSON, CSV, markdown),
and the check that a file belongs to the device it is inspected for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mla_tune.store.selection import device_key
from mla_tune.validate import InputError, check_int
from vllm_metax.core import choices, decisions, device as core_device
from vllm_metax.core.choices import SPECS
from vllm_metax.core.tuned_config import TunedConfigError
from mla_tune.problem.units import us, us_text
from mla_tune.views.render import Column, OutputFormat, Table, render, times, to_csv


def parse_lookup(text: str) -> tuple[int, int, int]:
    """`--lookup BATCH,CONTEXT[,Q_LEN]` -> (batch, context, q_len), each a size as --batches and
    --contexts write one (`32,6k`, `32,4K,2`); InputError when malformed."""
    from mla_tune.tune.sweep.buckets import parse_size    # lazy: the sweep's module imports torch
    parts = text.split(",")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        sizes = [parse_size(p) for p in parts]
    except ValueError:
        raise InputError(f"--lookup takes BATCH,CONTEXT[,Q_LEN] as positive sizes (32,6000 or "
                         f"32,6K), got {text[:80]!r}") from None
    vals = [check_int(k, v, "--lookup " + k.replace("_", " "))
            for k, v in zip(("batch", "context", "q_len"), sizes)]
    return (vals[0], vals[1], vals[2] if len(vals) == 3 else 1)


def check_config_device(cfg, path, device: str | None = None) -> None:
    """Raise TunedConfigError if the file belongs to another device than its name, `device`, or
    (without `device`) this machine's accelerator; a machine without one checks the name only."""
    name = Path(path).name
    if name.startswith("device_name=") and name.endswith(".json") and \
            device_key(name[len("device_name="):-len(".json")]) != device_key(cfg.device_name):
        raise TunedConfigError(f"{path}: the file name says {name[12:-5]!r} but it was written for "
                               f"device {cfg.device_name!r}; the plugin would ignore it")
    where = "--device"
    if device is None:
        dev = core_device.detect_device()
        if dev.source == "none":
            return
        device, where = dev.name, "this machine"
    if device_key(device) != device_key(cfg.device_name):
        raise TunedConfigError(f"{path}: written for device {cfg.device_name!r}, not {device!r} "
                               f"({where}); pass --device {cfg.device_name!r} to inspect it anyway")


def _value_text(v) -> str:
    """A provenance value for people: a list as `a, b`, a dict as `key value; key value` (the
    rules, the environment), never Python's repr."""
    if isinstance(v, dict):
        return "; ".join(f"{k} {_value_text(x)}" for k, x in v.items())
    if isinstance(v, list):
        return ", ".join(_value_text(x) for x in v)
    return str(v)


def _dims_title(e) -> str:
    d = e.dims
    dt = d.q_dtype if d.q_dtype == d.kv_dtype else f"{d.q_dtype}/{d.kv_dtype}"
    who = f"{e.model}{f' tp{e.tp_size}' if e.tp_size else ''} " if e.model else ""
    return f"{who}H{d.num_heads} (R{d.kv_lora_rank} P{d.qk_rope_head_dim} {dt})"


def _params_text(p: dict, family: str = "") -> str:
    """{"backend": "fa3"} -> "fa3"; {"backend": "triton", "num_kv_splits": 16} -> "num_kv_splits=16"
    (the one backend value of a family that has one, `KernelSpec.backends`, is not shown)."""
    backend = p.get("backend")
    knobs = [f"{k}={v}" for k, v in p.items() if k not in ("backend", "rule")]
    one = backend == family or (family in SPECS and SPECS[family].backends == (backend,))
    head = [str(backend)] if backend is not None and not one else []
    return ", ".join(head + knobs) or "-"


CONFIG_BUCKET_COLUMNS = [Column("batch"), Column("context"), Column("q"),
                         Column("family", justify="left"), Column("params", justify="left"),
                         Column("time us", us), Column("default us", us),
                         Column("gain", times), Column("significant"), Column("best", justify="left")]


def config_tables(cfg) -> list[Table]:
    """A tuned config as tables: provenance, the global choice per model, its buckets."""
    title = f"{cfg.device_name} (schema {cfg.schema_version})"
    t = Table(f"{title}: provenance", [Column("field", justify="left"),
                                       Column("value", justify="left", wrap=True)])
    for k, v in cfg.provenance.items():
        t.add(k, _value_text(v) if isinstance(v, (list, dict)) else v)
    tables = [t]
    g = Table(f"{title}: global choice per model", [Column("model entry", justify="left"),
              Column("page size"), Column("backend order", justify="left"),
              Column("buckets"), Column("why", justify="left", wrap=True)])
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
                        Column("time us", us), Column("default us", us),
                        Column("gain", times), Column("significant")])
            for p in e.prefill:
                gain = p.default_time_us / p.time_us if p.time_us and p.default_time_us else None
                pt.add("new tokens" if p.causal else "context chunk", p.query_tokens, p.kv_len,
                       p.backend, p.time_us, p.default_time_us, gain, p.significant)
            tables.append(pt)
    return tables


@dataclasses.dataclass(frozen=True)
class Served:
    """What the plugin runs for one request under one model entry: the attention backend vLLM
    selects (the entry's first), the kernel family its decode step runs and its parameters."""

    attention_backend: str | None
    family: str | None
    params: dict
    note: str = ""

    def text(self) -> str:
        if self.family is None:
            return self.note or "-"
        knobs = _params_text(self.params, self.family)
        kernel = self.family if knobs == "-" else f"{self.family} {knobs}"
        return f"{self.attention_backend}: {kernel}" + (f" ({self.note})" if self.note else "")


def served_kernel(entry, request: tuple) -> Served:
    """The kernel a decode step of `request` (batch, context, q_len) runs under `entry`, by the
    plugin's rule (`vllm_metax.core.decisions.decode_kernel`) for the entry's first attention
    backend, with why where it is not simply the bucket's best."""
    if entry is None or not entry.backend_order:
        return Served(None, None, {}, "no attention backend in the entry")
    served = decisions.decode_kernel(entry, decisions.DecodeStep(*request))
    backend, bucket, family = served.attention_backend, served.bucket, served.family
    if bucket is None:
        return Served(backend, None, {}, "no tuned bucket: the plugin's defaults")
    params = served.choice.to_params()
    if family == choices.TRITON:
        if served.choice.vllm_rule:
            tuned = decisions.bucket_choice(bucket, choices.TRITON)
            params = {k: v for k, v in params.items() if k == "variant"}
            return Served(backend, family, params, "vLLM's num_kv_splits rule" + (
                f" (context {request[1]} is more than {decisions.TRITON_CONTEXT_RATIO:g}x from the bucket's "
                f"{bucket.context_len})" if tuned is not None and not tuned.vllm_rule else ""))
        return Served(backend, family, params)
    if backend == decisions.FLASHMLA_BACKEND_NAME:
        return Served(backend, family, {})
    if family != choices.FLASHINFER:
        return Served(backend, family, params,
                      f"the bucket's FlashInfer choice not {decisions.SPLIT_MIN_GAIN:g}x faster" if family == choices.FA3 else
                      f">= {decisions.SPLIT_MIN_GAIN:g}x faster than the bucket's FlashInfer choice")
    if decisions.bucket_choice(bucket, choices.FLASHINFER) is None:
        return Served(backend, family, {}, "no FlashInfer choice: the device default")
    note = "planned as the device default" if served.choice.backend == decisions.AUTO else ""
    if bucket.best_family == choices.SPLIT and request[2] != 1:
        note = f"{choices.SPLIT} measured faster at q_len 1, it serves q_len 1 only"
    elif bucket.best_family in decisions.SIDE_KERNELS:
        note = f"{bucket.best_family} measured faster, by less than {decisions.SPLIT_MIN_GAIN:g}x"
    return Served(backend, family, params, note)


@dataclasses.dataclass(frozen=True)
class LookupAnswer:
    """One model entry's answer to a lookup: the bucket found, how it was found, what is served."""

    entry: object
    bucket: object | None
    exact: bool
    in_range: bool
    served: Served

    def to_json(self, request: tuple) -> dict:
        e, b = self.entry, self.bucket
        return {"model": e.model, "tp_size": e.tp_size, "dims": dataclasses.asdict(e.dims),
                "request": list(request), "page_size": e.page_size,
                "backend_order": list(e.backend_order),
                "bucket": None if b is None else [b.batch_size, b.context_len, b.q_len],
                "exact": self.exact, "in_range": self.in_range,
                "best_family": b.best_family if b is not None else None,
                "served": {"attention_backend": self.served.attention_backend,
                           "family": self.served.family, "params": self.served.params,
                           "note": self.served.note},
                "choices": {} if b is None else {
                    f: {"params": c.params, "time_us": c.time_us,
                        "default_time_us": c.default_time_us, "gain": c.gain,
                        "significant": c.significant} for f, c in b.families.items()}}


def lookup(cfg, request: tuple) -> list[LookupAnswer]:
    """Per model entry: the bucket the plugin serves (batch, context, q_len) from, and its kernel."""
    out = []
    for e in cfg.models:
        hit = e.lookup(*request)
        b = hit.bucket if hit is not None else None
        out.append(LookupAnswer(e, b, bool(hit and hit.exact), bool(hit and hit.in_range),
                                served_kernel(e, request)))
    return out


def lookup_tables(cfg, request: tuple) -> list[Table]:
    """The answer to `--lookup` alone: per model entry the kernel served first, then the bucket
    and every family's choice in it (not the rest of the config)."""
    batch, context, q_len = request
    t = Table(f"{cfg.device_name}: served for batch {batch}, context {context}, q_len {q_len}",
              [Column("model entry", justify="left"), Column("served", justify="left"),
               Column("page"), Column("bucket", justify="left"), Column("match", justify="left"),
               Column("best family", justify="left"), Column("choices", justify="left", wrap=True)],
              caption="served = the first attention backend of the entry's order and the kernel "
                      "its decode step runs; match = exact bucket, nearest on a log2 scale, or "
                      "outside the tuned range (the nearest edge bucket)")
    for a in lookup(cfg, request):
        b = a.bucket
        match = "exact" if a.exact else "nearest" if a.in_range else "outside tuned range"
        choices = "" if b is None else "; ".join(
            f"{f}: {_params_text(c.params, f)}" + (f" {us_text(c.time_us)}" if c.time_us else "")
            for f, c in sorted(b.families.items(), key=lambda x: (x[0] != b.best_family, x[0])))
        t.add(_dims_title(a.entry), a.served.text(), a.entry.page_size,
              None if b is None else f"B{b.batch_size} L{b.context_len} q{b.q_len}",
              None if b is None else match, b.best_family if b is not None else None, choices)
    return [t]


def lookup_json(cfg, request: tuple) -> dict:
    return {"device_name": cfg.device_name, "path": str(cfg.path) if cfg.path else None,
            "request": list(request), "lookup": [a.to_json(request) for a in lookup(cfg, request)]}


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


def render_config(cfg, fmt: str | OutputFormat, request: tuple | None = None) -> str | list:
    """A tuned config in a read format (table -> rich renderables, others -> text); with
    `request` = (batch, context, q_len), only the answer to that lookup."""
    if request is not None:
        return render(fmt, lambda: lookup_tables(cfg, request), f"lookup in {cfg.path or ''}",
                      lambda: lookup_json(cfg, request), lambda: lookup_csv(cfg, request))
    return render(fmt, lambda: config_tables(cfg),
                  f"tuned config {cfg.path or ''}".strip(), cfg.to_json, lambda: config_csv(cfg))


def lookup_csv(cfg, request: tuple) -> str:
    t = Table("lookup", [Column(c) for c in (
        "device_name", "model", "tp_size", "num_heads", "batch", "context", "q_len", "bucket_batch",
        "bucket_context", "bucket_q_len", "exact", "in_range", "best_family",
        "attention_backend", "served_family", "served_params")])
    for a in lookup(cfg, request):
        b = a.bucket
        t.add(cfg.device_name, a.entry.model, a.entry.tp_size, a.entry.dims.num_heads, *request,
              *((b.batch_size, b.context_len, b.q_len) if b is not None else (None,) * 3),
              int(a.exact), int(a.in_range), b.best_family if b is not None else None,
              a.served.attention_backend, a.served.family, a.served.params)
    return to_csv(t)
