"""A sweep for people: its plan (`mla-tune sweep --dry-run`) and its closing summary, as tables of
`mla_tune.views.render` (which fit the width or become lists)."""

from __future__ import annotations

from mla_tune.problem.units import us_text
from mla_tune.views.render import Column, Table
from mla_tune.tune.verdict import NO_SIGNIFICANT_DIFFERENCE
from mla_tune.views.report import CPU_CAVEAT
from vllm_metax.core.choices import SPECS

SHORT_KNOBS = {"num_kv_splits": "splits"}


def candidate_label(m) -> str:
    """A chosen candidate without its family and page (both are in the table's title)."""
    knobs = ",".join(f"{SHORT_KNOBS.get(k, k)}={v}" for k, v in sorted(m.params.items())
                     if k != "rule")
    if not knobs:
        return m.backend
    one = m.family in SPECS and SPECS[m.family].backends == (m.backend,)    # not worth showing
    return knobs if m.backend == m.family or one else f"{m.backend} {knobs}"


def verdict_text(v, reference: bool = False) -> str:
    """Short: the gain over the family default, or why the default stayed."""
    if v is None:
        return "-"
    if v.chosen is None:
        return "none valid"
    if reference:
        return ""
    if v.significant:
        return f"{v.gain:.2f}x"
    if v.reason.startswith(NO_SIGNIFICANT_DIFFERENCE):
        return "n.s." + (f" {v.ratio:.2f}x" if v.ratio else "")
    if v.default is None:
        return "no default"
    if not v.default.ok:
        return f"default {v.default.invalid_reason}"
    return "default"


def _cell(v, reference: bool) -> str | None:
    if v is None or v.chosen is None:
        return None if v is None else "none valid"
    if reference:       # no page is chosen for the CPU: the fastest page, as the progress said
        return f"{candidate_label(v.chosen)} p{v.chosen.page_size} {us_text(v.time_us)}"
    verdict = verdict_text(v, reference)
    return f"{candidate_label(v.chosen)} {us_text(v.time_us)}" + (f" {verdict}" if verdict else "")


def _fastest_page(b, family: str):
    """The CPU reference's verdict in a bucket at its fastest page (the candidate the sweep's
    progress line named best), not at the page a GPU's choice would fix."""
    at = [pv[family] for pv in b.per_page.values()
          if family in pv and pv[family].time_us is not None]
    return min(at, key=lambda v: v.time_us) if at else b.families.get(family)


def summary_tables(choice) -> list[Table]:
    """Per model entry, per bucket and family: the chosen candidate, its time and its gain over
    the family default (n.s. = no significant difference); `*` marks the bucket's fastest family.
    A CPU reference sweep shows its timings with CPU_CAVEAT and no verdict."""
    reference = choice.kind == "cpu-reference"
    tables = []
    for m in choice.models:
        fams = list(m.family_order) or sorted({f for b in m.buckets for f in b.families})
        show_q = any(b.q_len != 1 for b in m.buckets)
        lengths = "" if m.ragged == "uniform" else f", {m.ragged} lengths"
        title = (f"{m.model} TP{m.tp_size or '?'} ({m.num_heads} heads/rank, {m.q_dtype}/"
                 f"{m.kv_dtype}{lengths}) on {choice.device_name}"
                 + ("" if reference else f", page {m.page_size}"))
        cols = [Column("B"), Column("L")] + ([Column("q")] if show_q else []) + [
            Column(f, justify="left") for f in fams]
        if reference:
            caption = CPU_CAVEAT
        else:
            caption = (f"gain over the family default: shown when Mann-Whitney p < "
                       f"{choice.p_threshold:g} and >= {choice.min_ratio:g}x; n.s. = no "
                       "significant difference (the default stays); * = fastest family in the "
                       f"bucket. Page size {m.page_size} ({m.page_reason}); backend order "
                       f"{' > '.join(m.backend_order) or ' > '.join(m.family_order)} "
                       f"({m.order_reason})")
        t = Table(title, cols, caption=caption)
        for b in m.buckets:
            cells = []
            for f in fams:
                c = _cell(_fastest_page(b, f) if reference else b.families.get(f), reference)
                if c and len(fams) > 1 and f == b.best_family and not reference:
                    c = "*" + c
                cells.append(c)
            t.add(b.batch_size, b.context_len, *([b.q_len] if show_q else []), *cells)
        tables.append(t)
    return tables


def plan_tables(plan, estimate: str) -> list[Table]:
    """`mla-tune sweep --dry-run`: every bucket with its search mode, space and budget."""
    where = f"replay of {plan.db}" if plan.replay else f"{plan.device}, into {plan.db}"
    t = Table(f"mla-tune sweep --dry-run on {where}: families {', '.join(plan.families) or '-'}",
              [Column("bucket", justify="left"), Column("heads"), Column("search", justify="left"),
               Column("candidates"), Column("budget")],
              caption=f"{estimate}. Dry run: nothing measured, nothing written"
                      + "".join(f"; skipped {f}: {why}" for f, why in plan.skipped.items()))
    for p in plan.buckets:
        t.add(p.bucket.label, p.bucket.workload.num_heads, p.mode, len(p.space), p.budget)
    return [t]
