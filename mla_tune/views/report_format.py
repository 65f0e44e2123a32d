"""A Report (mla_tune.views.report) in the read formats of mla_tune.views.render: the full tables
(per device its runs, candidates per workload, best per bucket, global choice), the one-screen
summary, every candidate line as CSV, and `render_report(report, fmt)` choosing among them."""

from __future__ import annotations

import dataclasses

from mla_tune.problem.units import us
from mla_tune.views import prefill_view
from mla_tune.views.render import Column, OutputFormat, Table, render, times, to_csv
from mla_tune.views.report import CPU_CAVEAT, CPU_LABEL, DeviceReport, Report
from vllm_metax.core.choices import SPECS


def _pct(v) -> str:
    return f"{v * 100:.1f}%"


def _short(text: str, n: int = 90) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def entry_title(m) -> str:
    tp = f" tp{m.tp_size}" if getattr(m, "tp_size", None) else ""
    dt = m.q_dtype if m.q_dtype == m.kv_dtype else f"{m.q_dtype}/{m.kv_dtype}"
    r = "" if m.ragged == "uniform" else f", {m.ragged} lengths"
    return f"{m.model}{tp} H{m.num_heads} (R{m.kv_lora_rank} P{m.qk_rope_head_dim} {dt}{r})"


def _device_title(d: DeviceReport) -> str:
    return d.device_name + (f" [{CPU_LABEL}]" if d.is_reference else "")


RUN_COLUMNS = [Column("run", justify="right"), Column("kind", justify="left"),
               Column("started", justify="left"), Column("host", justify="left"),
               Column("torch", justify="left"), Column("flashinfer", justify="left"),
               Column("SMs"), Column("copy GB/s", ".0f"), Column("matmul TFLOP/s", ".0f")]

CANDIDATE_COLUMNS = [Column("workload", justify="left"), Column("candidate", justify="left"),
                     Column("median us", us), Column("spread", _pct), Column("n"),
                     Column("% roofline", ".1f"), Column("vs default", times),
                     Column("choice", justify="left"), Column("status", lambda s: _short(s), "left", wrap=True)]

BUCKET_COLUMNS = [Column("batch"), Column("context"), Column("q"), Column("family", justify="left"),
                  Column("chosen", justify="left"), Column("median us", us),
                  Column("default us", us), Column("gain", times), Column("% roofline", ".1f"),
                  Column("best", justify="left"), Column("why", justify="left", wrap=True)]

GLOBAL_COLUMNS = [Column("model entry", justify="left"), Column("page size"),
                  Column("backend order", justify="left"), Column("why", justify="left", wrap=True)]


def report_tables(report: Report) -> list[Table]:
    """The report as titled tables: per device its runs, candidates, best per bucket, global choice."""
    tables = []
    for d in report.devices:
        title = _device_title(d)
        t = Table(f"{title}: runs", RUN_COLUMNS)
        for r in d.runs:
            t.add(r["id"], r.get("kind"), r.get("started_at"), r.get("host"), r.get("torch"),
                  r.get("flashinfer"), r.get("sm_count"), r.get("copy_gbps"), r.get("matmul_tflops"))
        if d.superseded:
            t.caption = (f"{d.superseded} older trial(s) of re-measured candidates are not shown "
                         "(the latest trial per workload and candidate counts)")
        tables.append(t)
        for m in d.choice.models:
            views = d.views_of(m)
            t = Table(f"{title} · {entry_title(m)}: candidates per workload", CANDIDATE_COLUMNS,
                      caption="spread = interquartile range / median; % roofline = 100 x floor "
                              "(bytes at copy speed or FLOPs at matmul speed) / median; vs default = "
                              "family default's median / this median"
                              + ("" if any(w.floor_us for w in views) else
                                 "; no ceilings recorded for these runs, so no % roofline"))
            for w in views:
                for i, c in enumerate(w.lines):
                    t.add(w.label if i == 0 else "", c.candidate,
                          c.median_us, c.spread, c.n or None, c.pct_roofline, c.speedup_vs_default,
                          c.verdict, c.status_text())
            tables.append(t)
            tables.append(_bucket_table(d, m, views, title))
        if d.is_reference:
            tables.append(Table(f"{title}: global choice: none", [], caption=CPU_CAVEAT))
            continue
        t = Table(f"{title}: global choice", GLOBAL_COLUMNS,
                  caption=f"rules: a challenger replaces a default only if Mann-Whitney p < "
                          f"{d.choice.p_threshold:g} and it is >= {d.choice.min_ratio:g}x faster; "
                          + ("; ".join(d.choice.notes) if d.choice.notes else "no warnings"))
        _add_global_rows(t, d)
        tables.append(t)
    tables += prefill_view.prefill_tables(report.prefill)
    return tables


# each kernel spec's abbreviation and title (`KernelSpec.abbr`, `.title`), and the torch reference's
_FAMILY_ABBR = {**{f: s.abbr for f, s in SPECS.items()}, "reference": "ref"}
_FAMILY_WORDS = {**{f: s.title for f, s in SPECS.items()}, "reference": "torch reference"}


def _legend(families) -> str:
    """The abbreviations of the families a table shows (all of them when it shows none)."""
    shown = [f for f in _FAMILY_ABBR if f in families] or list(_FAMILY_ABBR)
    return ", ".join(f"{_FAMILY_ABBR[f]} = {_FAMILY_WORDS[f]}" for f in shown)


def _best_cell(b) -> str | None:
    v = b.families.get(b.best_family) if b.best_family else None
    if v is None or v.chosen is None or v.time_us is None:
        return None
    star = "*" if v.significant else ""
    return f"{_FAMILY_ABBR.get(b.best_family, b.best_family)} {us(v.time_us)}{star}"


def _fastest_cell(b) -> str | None:
    """A CPU reference bucket: its fastest candidate at any page (`ref p16 1932`)."""
    at = [v for pv in b.per_page.values() for v in pv.values() if v.time_us is not None]
    if not at:
        return None
    v = min(at, key=lambda v: v.time_us)
    return f"{_FAMILY_ABBR.get(v.family, v.family)} p{v.page_size} {us(v.time_us)}"


def _grid_key(m) -> tuple:
    """Model entries that share one grid: all but their request lengths (uniform, zipf ...)."""
    return (m.model, m.tp_size, m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.q_dtype,
            m.kv_dtype, m.page_size)


def _totals_text(m) -> str:
    """The weighted total of each family at the entry's page, fastest first: `f3 8419, fi 8727`
    (`(3/4)` where a family has no valid candidate in some buckets)."""
    at = sorted((t for t in m.totals if t.page_size == m.page_size),
                key=lambda t: (-t.covered, t.total_us))
    return ", ".join(f"{_FAMILY_ABBR.get(t.family, t.family)} {us(t.total_us)}"
                     + ("" if t.complete else f" ({t.covered}/{t.of})") for t in at) or "-"


def summary_tables(report: Report) -> list[Table]:
    """The one-screen view: per model entry the fastest family and its time in every bucket
    (batch x context; the entry's non-uniform request lengths as rows of the same grid), then
    the verdict per entry (page size, backend order, the weighted totals that ranked it) and
    the prefill buckets where a backend beat the default. `report_tables` has everything."""
    tables = []
    for d in report.devices:
        title = _device_title(d)
        grids: dict = {}
        for m in d.choice.models:
            grids.setdefault(_grid_key(m), []).append(m)
        for entries in grids.values():
            m0 = next((m for m in entries if m.ragged == "uniform"), entries[0])
            buckets = [(m.ragged, b) for m in entries for b in m.buckets]
            contexts = sorted({b.context_len for _, b in buckets})
            rows = sorted({(r != "uniform", r, b.q_len, b.batch_size) for r, b in buckets})
            cells = {(r, b.q_len, b.batch_size, b.context_len): _best_cell(b) for r, b in buckets}
            show_q = any(q != 1 for _, _, q, _ in rows)
            cols = [Column("batch")] + ([Column("q")] if show_q else []) + [
                Column(f"L{c}", justify="right") for c in contexts]
            page = f"page {m0.page_size}" if m0.page_size is not None else "no page chosen"
            name = entry_title(dataclasses.replace(m0, ragged="uniform"))
            if d.is_reference:      # no page is chosen: each bucket's fastest, as the sweep shows
                cells = {(r, b.q_len, b.batch_size, b.context_len): _fastest_cell(b)
                         for r, b in buckets}
                t = Table(f"{title} · {name}: CPU reference time per bucket, us", cols,
                          caption=CPU_CAVEAT)
            else:
                t = Table(f"{title} · {name}: fastest per bucket, us ({page})", cols,
                          caption=_legend({b.best_family for _, b in buckets}) + "; * = beat "
                                  "its family default significantly"
                                  + ("; a `zipf` row: lengths drawn around the column's mean"
                                     if any(r != "uniform" for r, _ in buckets) else ""))
            for _, r, q, bsz in rows:
                t.add(bsz if r == "uniform" else f"{bsz} {r}", *([q] if show_q else []),
                      *[cells.get((r, q, bsz, c)) for c in contexts])
            tables.append(t)
        if d.is_reference:
            continue        # CPU_CAVEAT: no verdict from the CPU reference
        t = Table(f"{title}: verdict (weighted totals in us)",
                  [Column("model entry", justify="left"), Column("page"),
                   Column("backend order", justify="left"),
                   Column("totals", justify="left", wrap=True)],
                  caption=f"{len(d.workloads)} workloads, {sum(len(w.lines) for w in d.workloads)} "
                          "candidate lines; `mla-tune report --full` lists them and says why"
                          + ("; " + "; ".join(d.choice.notes) if d.choice.notes else ""))
        models = {m.model for m in d.choice.models}
        for m in d.choice.models:
            name = f"{m.model} " if len(models) > 1 else ""
            tp = f"tp{m.tp_size} " if m.tp_size else ""
            lengths = "" if m.ragged == "uniform" else f" {m.ragged}"
            t.add(f"{name}{tp}H{m.num_heads}{lengths}", m.page_size,
                  " > ".join(m.backend_order) or " > ".join(m.family_order), _totals_text(m))
        tables.append(t)
    tables += prefill_view.prefill_tables(report.prefill, full=False)
    return tables


def _bucket_table(d: DeviceReport, m, views: list, title: str) -> Table:
    page = f"page {m.page_size}" if m.page_size is not None else "no page chosen"
    t = Table(f"{title} · {entry_title(m)}: best per bucket ({page})", BUCKET_COLUMNS)
    lines = {c.trial_id: c for w in views for c in w.lines}
    for b in m.buckets:
        fams = sorted(b.families, key=lambda f: (f != b.best_family, f))
        if not any(v.chosen for v in b.families.values()):
            t.add(b.batch_size, b.context_len, b.q_len, None, None, None, None, None, None, "",
                  "no valid candidate" + (f" at page {m.page_size}" if m.page_size else ""))
            fams = [f for f in fams if b.families[f].chosen]
        for f in fams:
            v = b.families[f]
            line = lines.get(v.chosen.trial_id) if v.chosen else None
            t.add(b.batch_size, b.context_len, b.q_len, f, v.chosen.key if v.chosen else None,
                  v.time_us, v.default_time_us, v.gain, line.pct_roofline if line else None,
                  "best" if f == b.best_family else "", v.reason)
    return t


def report_csv(report: Report) -> str:
    """Every candidate line as one CSV row with raw numbers (the stored values, unrounded)."""
    cols = ["device_name", "kind", "model", "num_heads", "kv_lora_rank", "qk_rope_head_dim",
            "q_dtype", "kv_dtype", "ragged", "batch_size", "context_len", "q_len", "workload_id",
            "run_id", "trial_id", "candidate", "family", "backend", "page_size", "params",
            "is_default", "status", "invalid_reason", "message", "n", "median_us", "spread",
            "min_us", "plan_median_us", "compile_s", "max_rel_error", "pct_roofline", "floor_us",
            "bound", "default_candidate", "speedup_vs_default", "chosen", "winner"]
    t = Table("candidates", [Column(c) for c in cols])
    for d, w, c in report.lines():
        t.add(d.device_name, d.kind, w.model, w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim,
              w.q_dtype, w.kv_dtype, w.ragged, w.batch_size, w.context_len, w.q_len, w.workload_id,
              c.run_id, c.trial_id, c.candidate, c.family, c.backend, c.page_size, c.params,
              int(c.is_default), c.status, c.invalid_reason, c.message, c.n, c.median_us, c.spread,
              c.min_us, c.plan_median_us, c.compile_s, c.max_rel_error, c.pct_roofline, w.floor_us,
              w.bound, c.default_candidate, c.speedup_vs_default, int(c.chosen), int(c.winner))
    for row in prefill_view.prefill_csv_rows(report.prefill_records):
        t.add(*[row.get(col) for col in cols])
    return to_csv(t)


def render_report(report: Report, fmt: str | OutputFormat, full: bool = False) -> str | list:
    """json, csv, markdown -> text; table -> a list of rich renderables. Table and markdown show
    the one-screen summary unless `full`; json and csv always carry every line."""
    return render(fmt, lambda: report_tables(report) if full else summary_tables(report),
                  f"mla-tune report: {report.db} ({report.filter.describe()})",
                  report.to_json, lambda: report_csv(report))


def _add_global_rows(t: Table, d) -> None:
    """One row per model entry: page size, attention-backend order and why."""
    for m in d.choice.models:
        order = " > ".join(m.backend_order) or (
            " > ".join(m.family_order) + " (no vLLM attention backend measured)")
        t.add(entry_title(m), m.page_size, order, f"{m.page_reason}. {m.order_reason}")
