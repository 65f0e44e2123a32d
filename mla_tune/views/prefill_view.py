"""The MLA prefill part of `mla-tune report`: per device and head count, each prefill bucket
`mla-tune prefill-sweep` measured, the time of every FlashInfer backend value, and the verdict
`emit` writes into the config's prefill section (`mla_tune.tune.prefill.choose_prefill`: the
decode rule, p < 0.002 and >= 1.05x over the device default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mla_tune.store.records import TrialRecord
from mla_tune.store.selection import TrialFilter
from mla_tune.tune import choose as choosing
from mla_tune.problem.units import us
from mla_tune.views.render import Column, Table


@dataclass
class PrefillLine:
    """One prefill bucket of one device: times per backend value and the verdict."""

    device_name: str
    num_heads: int
    model: str
    causal: bool
    query_tokens: int
    requests: int
    kv_len: int                      # KV tokens per request
    times_us: dict = field(default_factory=dict)    # backend value -> median us (valid ones)
    invalid: dict = field(default_factory=dict)     # backend value -> reason
    default: str | None = None
    chosen: str | None = None
    ratio: float | None = None
    p_value: float | None = None
    significant: bool = False
    reason: str = ""

    @property
    def kind(self) -> str:
        return "new" if self.causal else "context"

    def to_json(self) -> dict:
        return {"device_name": self.device_name, "model": self.model, "num_heads": self.num_heads,
                "kind": self.kind, "causal": self.causal, "query_tokens": self.query_tokens,
                "requests": self.requests, "kv_len": self.kv_len, "times_us": self.times_us,
                "invalid": self.invalid, "default": self.default, "chosen": self.chosen,
                "ratio": self.ratio, "p_value": self.p_value, "significant": self.significant,
                "reason": self.reason}


def prefill_records(store, flt: TrialFilter) -> list[TrialRecord]:
    """The prefill trials `flt` selects (every one, not only the latest per candidate)."""
    return store.records(*flt.where(), prefill=True)


def build_prefill(store, flt: TrialFilter, **choose_kw) -> list[PrefillLine]:
    """One line per (device, prefill bucket), devices and heads in a stable order."""
    from mla_tune.tune.prefill import choose_prefill      # lazy: it imports torch (the measuring side)
    records = prefill_records(store, flt)
    by_device: dict = {}
    for r in records:
        by_device.setdefault(r.device_name or "", []).append(r)
    lines = []
    for device in sorted(by_device):
        for dims, verdicts in sorted(choose_prefill(by_device[device], **choose_kw).items(),
                                     key=lambda kv: -kv[0].num_heads):
            for pv in verdicts:
                w, v = pv.workload, pv.verdict
                lines.append(PrefillLine(device, w.num_heads, w.model, w.causal, w.query_tokens,
                                         w.requests, w.kv_len,
                                         default=v.default.backend if v.default else None,
                                         chosen=v.chosen.backend if v.chosen else None,
                                         ratio=v.ratio, p_value=v.p_value,
                                         significant=bool(v.significant), reason=v.reason))
    _fill_all_backends(lines, records)
    return lines


def _fill_all_backends(lines: list[PrefillLine], records: list[TrialRecord]) -> None:
    """Each backend value's latest time (or why it has none) per bucket."""
    index = {(ln.device_name, ln.num_heads, ln.causal, ln.query_tokens, ln.requests, ln.kv_len): ln
             for ln in lines}
    for rec in choosing.latest_trials(records):
        w = rec.workload
        ln = index.get((rec.device_name or "", w.num_heads, w.causal, w.query_tokens, w.requests,
                        w.kv_len)) if w is not None else None
        if ln is None:
            continue
        st = rec.stats() if rec.ok else None
        if st is not None:
            ln.times_us[rec.candidate.backend] = st.median
        else:
            ln.invalid[rec.candidate.backend] = rec.invalid_reason or rec.status


def prefill_tables(lines: list[PrefillLine], full: bool = True) -> list[Table]:
    """One table per (device, heads): each bucket's time per backend value and what is served;
    not `full` (the one-screen summary): only the buckets where a value beat the default."""
    groups: dict = {}
    for ln in lines:
        groups.setdefault((ln.device_name, ln.model, ln.num_heads), []).append(ln)
    tables = []
    for (device, model, heads), group in groups.items():
        backends = sorted({b for ln in group for b in (*ln.times_us, *ln.invalid)})
        # short names: three backends (fa2, fa3, vllm_fa3) fit 80 columns as a table
        cols = [Column("plan", justify="left"), Column("tokens"), Column("req"),
                Column("KV/req")] + [Column(b, us) for b in backends] + [
                Column("served", justify="left"), Column("gain", ".2f")]
        shown = group if full else [ln for ln in group if ln.significant]
        kept = sum(not ln.significant for ln in group)
        defaults = sorted({ln.default for ln in group if ln.default})
        t = Table(f"MLA prefill backend: {device}, {model} H{heads}: time per backend, us", cols,
                  caption=f"{len(group)} prefill buckets; {kept} keep the device default "
                          f"({', '.join(defaults) or '-'}){'' if full else ' (--full lists them)'}; "
                          "a backend replaces it at p < 0.002 and >= 1.05x; tokens: the step's "
                          "query tokens over req requests of KV/req tokens each")
        for ln in shown:
            t.add(ln.kind, ln.query_tokens, ln.requests, ln.kv_len,
                  *[ln.times_us.get(b) for b in backends], ln.chosen,
                  ln.ratio if ln.significant else None)
        tables.append(t)
    return tables


def prefill_csv_rows(records: list[TrialRecord]):
    """(workload and trial values) per prefill trial, for the report's CSV: the decode columns
    that apply, the rest empty. `ragged` names the plan kind (prefill-causal | prefill-context)."""
    for rec in records:
        s, c = rec.stored, rec.candidate
        st = rec.stats() if rec.ok else None
        yield {"device_name": rec.device_name, "kind": rec.run_kind, "model": s.model,
               "num_heads": s.num_heads, "kv_lora_rank": s.kv_lora_rank,
               "qk_rope_head_dim": s.qk_rope_head_dim, "q_dtype": s.q_dtype, "kv_dtype": s.kv_dtype,
               "ragged": s.ragged, "batch_size": s.batch_size, "context_len": s.context_len,
               "q_len": s.q_len, "workload_id": s.id, "run_id": rec.run_id, "trial_id": rec.id,
               "candidate": rec.key, "family": c.family, "backend": c.backend,
               "page_size": c.page_size, "params": dict(c.params),
               "is_default": None if rec.is_default is None else int(rec.is_default),
               "status": rec.status, "invalid_reason": rec.invalid_reason, "message": rec.message,
               "n": len(rec.values()), "median_us": st.median if st else None,
               "compile_s": rec.compile_s, "max_rel_error": rec.max_rel_error}


__all__ = ["PrefillLine", "build_prefill", "prefill_csv_rows", "prefill_records", "prefill_tables"]
