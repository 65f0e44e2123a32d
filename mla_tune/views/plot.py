"""Plots of a report (matplotlib, Agg backend: no display needed), as small multiples.

One row per model entry of each device, the same two panels in every row, sharing their axes:
the tuned choice's speed-up over the untuned default per bucket (context on x, one line per
batch size, the served kernel family as the marker), and the tuned choice's % of the roofline
floor. A CPU-reference entry gets its timings' caveat instead of panels: they are no verdict.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from mla_tune.validate import InputError, is_png, make_parent, output_file
from mla_tune.views.report import CPU_CAVEAT, DeviceReport, Report, ReportError
from mla_tune.views.report_format import entry_title
from vllm_metax.core.choices import SPECS
from vllm_metax.core.decisions import SPLIT_MIN_GAIN

# matplotlib is imported by the functions that draw: a report without --plot never loads it

FAMILY_MARKERS = {"flashinfer": "o", "split": "s", "triton": "^", "flashmla": "D", "fa3_mla": "v",
                  "reference": "x"}
FAMILY_NAMES = {**{f: s.title for f, s in SPECS.items()}, "reference": "torch reference"}


@dataclass(frozen=True)
class BucketPoint:
    """One bucket as the plot shows it: what is served there against the untuned default."""

    batch_size: int
    context_len: int
    family: str                      # the kernel family served (by the plugin's split rule)
    time_us: float
    default_us: float | None         # FlashInfer's default at the entry's page (the untuned plugin)
    pct_roofline: float | None

    @property
    def speedup(self) -> float | None:
        return self.default_us / self.time_us if self.default_us and self.time_us else None


def bucket_points(dev: DeviceReport, m) -> list[BucketPoint]:
    """The served choice per q_len-1 bucket of a model entry: the fastest family, except that
    FLASHINFER_MLA serves the split kernel only where it beats FlashInfer's choice by the
    plugin's margin (`vllm_metax.core.decisions.SPLIT_MIN_GAIN`), as the plugin does."""
    lines = {c.trial_id: c for w in dev.views_of(m) for c in w.lines}
    out = []
    for b in m.buckets:
        if b.q_len != 1 or b.best_family is None:
            continue
        fam = b.best_family
        fi = b.families.get("flashinfer")
        if fam == "split" and fi is not None and fi.time_us and \
                fi.time_us < SPLIT_MIN_GAIN * b.families[fam].time_us:
            fam = "flashinfer"
        v = b.families[fam]
        if v.chosen is None or not v.time_us:
            continue
        base = fi if fi is not None else v
        line = lines.get(v.chosen.trial_id)
        out.append(BucketPoint(b.batch_size, b.context_len, fam, v.time_us, base.default_time_us,
                               line.pct_roofline if line else None))
    return out


def _entries(report: Report):
    for d in report.devices:
        for m in d.choice.models:
            if d.views_of(m):
                yield d, m


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def report_figure(report: Report):
    """The report's small multiples as one matplotlib Figure (Agg)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    blocks = list(_entries(report))
    if not blocks:
        raise ReportError("nothing to plot: no valid measurements in the selection")
    points = [bucket_points(d, m) for d, m in blocks]
    batches = sorted({p.batch_size for ps in points for p in ps})
    cmap = matplotlib.colormaps["viridis"]
    color = {b: cmap(i / max(1, len(batches) - 1) * 0.9) for i, b in enumerate(batches)}
    fig, axes = plt.subplots(len(blocks), 2, figsize=(13, 3.3 * len(blocks) + 1.2),
                             squeeze=False, sharex="col", sharey="col",
                             layout="constrained")
    for row, ((dev, m), pts) in enumerate(zip(blocks, points)):
        ax_gain, ax_roof = axes[row]
        label = f"{dev.device_name} · {entry_title(m)}"
        if dev.is_reference:
            for ax in (ax_gain, ax_roof):
                ax.set_axis_off()
            ax_gain.text(0, 0.5, f"{label}\n{_wrap(CPU_CAVEAT, 70)}", transform=ax_gain.transAxes,
                         va="center", fontsize=9)
            ax_gain.set_title(f"{label}: CPU torch reference, no verdict", fontsize=10)
            continue
        _lines(ax_gain, pts, color, lambda p: p.speedup)
        ax_gain.axhline(1.0, color="grey", lw=1, ls="--")
        ax_gain.set_ylabel("speed-up over default")
        ax_gain.set_title(f"{label}\ntuned vs untuned default (FlashInfer's default, page "
                          f"{m.page_size})", fontsize=10)
        _lines(ax_roof, pts, color, lambda p: p.pct_roofline)
        ax_roof.axhline(100.0, color="grey", lw=1, ls="--")
        ax_roof.set_ylim(0, 110)
        ax_roof.set_ylabel("% of roofline floor")
        ceil = next(((r.get("copy_gbps"), r.get("matmul_tflops")) for r in dev.runs
                     if r.get("copy_gbps") and r.get("matmul_tflops")), None)
        ax_roof.set_title(f"{label}\ntuned choice's % of roofline" + (
            f" (copy {ceil[0]:.0f} GB/s, matmul {ceil[1]:.0f} TFLOP/s)" if ceil else
            ": no ceilings recorded"), fontsize=10)
        if not any(p.pct_roofline for p in pts):
            ax_roof.text(0.5, 0.5, "no copy/matmul ceilings recorded for these runs",
                         transform=ax_roof.transAxes, ha="center", va="center", fontsize=9)
    contexts = sorted({p.context_len for ps in points for p in ps})
    for ax in axes[-1]:
        if ax.axison:
            ax.set_xlabel("context length (KV tokens per request)")
    for ax in axes.flat:
        if ax.axison and contexts:
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [_k(c) for c in contexts])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
    families = sorted({p.family for ps in points for p in ps})
    handles = [Line2D([], [], color=color[b], lw=2, label=f"batch {b}") for b in batches]
    handles += [Line2D([], [], color="black", marker=FAMILY_MARKERS.get(f, "o"), ls="",
                       label=f"served: {FAMILY_NAMES.get(f, f)}") for f in families]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(6, len(handles)),
                   fontsize=8)
    fig.suptitle(f"mla-tune report of {Path(report.db).name} ({report.filter.describe()}): "
                 "tuned vs default speed-up and % of roofline per bucket", fontsize=12,
                 fontweight="bold")
    return fig


def _lines(ax, pts, color, value) -> None:
    """One line per batch size over context; each point's marker is the family served there."""
    for b in sorted({p.batch_size for p in pts}):
        row = sorted((p for p in pts if p.batch_size == b and value(p) is not None),
                     key=lambda p: p.context_len)
        if not row:
            continue
        ax.plot([p.context_len for p in row], [value(p) for p in row], color=color[b], lw=1.5)
        for p in row:
            ax.plot(p.context_len, value(p), marker=FAMILY_MARKERS.get(p.family, "o"), ms=6,
                    color=color[b], ls="")


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width))


def plot_report(report: Report, path: str | Path, dpi: int = 110) -> Path:
    """Write the report's plots to one PNG; returns the path."""
    return write_png(path, lambda: report_figure(report), dpi)


def write_png(path: str | Path, figure, dpi: int = 110) -> Path:
    """Write the matplotlib figure `figure()` makes to a PNG (a new file or an earlier plot only,
    never over a DB or a folder) and close it; returns the path, InputError in one line where it
    cannot be written."""
    import matplotlib.pyplot as plt

    path = output_file(path, "plot", own=is_png, suffix=".png")
    fig = figure()
    try:
        make_parent(path)
        fig.savefig(path, dpi=dpi, format="png")
    except OSError as e:
        raise InputError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
