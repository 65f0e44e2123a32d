"""Plots of a report (matplotlib, Agg backend: no display needed).

Per model entry of each device, one block: kernel time against context length per candidate (one
panel per batch size), the winner per (batch, context) bucket as a heatmap, and the winner's % of
the roofline floor as a heatmap. Every title says what it shows and where the numbers come from.
"""

from __future__ import annotations

import math
from pathlib import Path

from mla_tune.views.report import CandidateLine, DeviceReport, Report, ReportError, entry_title

MAX_BATCH_PANELS = 8             # time-vs-context panels per entry; more batch sizes are thinned out
FAMILY_CMAPS = {"flashinfer": "Blues", "triton": "Oranges", "flashmla": "Greens", "split": "Purples", "reference": "Greys"}


def _entries(report: Report):
    for d in report.devices:
        for m in d.choice.models:
            views = d.views_of(m)
            if views:
                yield d, m, views


def _thin(values: list, n: int) -> list:
    if len(values) <= n:
        return values
    idx = sorted({round(i * (len(values) - 1) / (n - 1)) for i in range(n)})
    return [values[i] for i in idx]


def _short_label(c: CandidateLine) -> str:
    return _series_label(_series_key(c))


def _colors(keys: list[tuple]) -> dict:
    """A colour per (family, configuration): a colormap per family, shades within it."""
    import matplotlib

    by_family: dict = {}
    for k in keys:
        by_family.setdefault(k[0], []).append(k)
    out = {}
    for fam, ks in by_family.items():
        cmap = matplotlib.colormaps[FAMILY_CMAPS.get(fam, "Greens")]
        for i, k in enumerate(ks):
            out[k] = cmap(0.45 + 0.5 * i / (len(ks) - 1) if len(ks) > 1 else 0.75)
    return out


def report_figure(report: Report):
    """The report's plots as one matplotlib Figure (Agg); titles say what each panel shows."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    blocks = list(_entries(report))
    if not blocks:
        raise ReportError("nothing to plot: no valid measurements in the selection")
    ncols = 4
    heights = []
    for _, _, views in blocks:
        nb = len(_thin(sorted({w.batch_size for w in views}), MAX_BATCH_PANELS))
        heights.append(1 + math.ceil(nb / ncols))
    fig = plt.figure(figsize=(5.2 * ncols, 4.2 * sum(heights) + 0.6 * len(blocks)),
                     layout="constrained")
    subfigs = fig.subfigures(len(blocks), 1, height_ratios=heights, squeeze=False)[:, 0]
    for sf, (dev, m, views) in zip(subfigs, blocks):
        _plot_entry(sf, dev, m, views, ncols)
    fig.suptitle(f"mla-tune report of {Path(report.db).name} ({report.filter.describe()}): "
                 "MLA decode kernel time vs context length per candidate, winner per bucket, "
                 "% of roofline", fontsize=14, fontweight="bold")
    return fig


def plot_report(report: Report, path: str | Path, dpi: int = 110) -> Path:
    """Write the report's plots to one PNG; returns the path."""
    import matplotlib.pyplot as plt

    from mla_tune.validate import InputError, is_png, make_parent, output_file

    path = output_file(path, "plot", own=is_png, suffix=".png")   # never over a DB or a folder
    fig = report_figure(report)
    try:
        make_parent(path)
        fig.savefig(path, dpi=dpi, format="png")
    except OSError as e:
        raise InputError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def _plot_entry(sf, dev: DeviceReport, m, views: list, ncols: int) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ref = " — CPU torch reference, not a GPU kernel" if dev.is_reference else ""
    sf.suptitle(f"{dev.device_name} · {entry_title(m)} · {_page(m)}, "
                f"{' > '.join(m.backend_order) or 'no vLLM backend measured'}{ref}",
                fontsize=12, fontweight="bold")
    batches = _thin(sorted({w.batch_size for w in views}), MAX_BATCH_PANELS)
    nrows = 1 + math.ceil(len(batches) / ncols)
    gs = sf.add_gridspec(nrows, ncols)
    # row 0: winner heatmap (2 columns) and % of roofline heatmap (2 columns)
    ax_win = sf.add_subplot(gs[0, :2])
    ax_roof = sf.add_subplot(gs[0, 2:])
    _winner_heatmap(ax_win, m, views)
    _roofline_heatmap(ax_roof, m, views, dev)
    # time vs context per candidate, one panel per batch size
    q_lens = sorted({w.q_len for w in views})
    lines = [c for w in views if w.q_len == q_lens[0] for c in w.lines if c.ok]
    keys = sorted({(c.family, _series_key(c)) for c in lines})
    colors = _colors(keys)
    on_page = {k: k[1][2] == m.page_size for k in keys}
    always_default = {k: all(c.is_default for c in lines if (c.family, _series_key(c)) == k)
                      for k in keys}
    for i, b in enumerate(batches):
        ax = sf.add_subplot(gs[1 + i // ncols, i % ncols])
        bviews = [w for w in views if w.batch_size == b and w.q_len == q_lens[0]]
        series: dict = {}
        for w in sorted(bviews, key=lambda w: w.context_len):
            for c in w.lines:
                if c.ok:
                    series.setdefault((c.family, _series_key(c)), []).append((w.context_len, c.median_us, c))
        for key, pts in sorted(series.items()):
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", ms=3, color=colors[key], lw=_lw(on_page[key], always_default[key]),
                    ls="--" if always_default[key] else "-", alpha=1.0 if on_page[key] else 0.35)
            dflt = [(x, y) for x, y, c in pts if c.is_default and not always_default[key]]
            if dflt:   # a knob value that is the family default at some contexts only
                ax.scatter(*zip(*dflt), marker="o", s=40, facecolors="none", edgecolors="black",
                           zorder=4)
            wins = [(x, y) for x, y, c in pts if c.winner]
            if wins:
                ax.scatter(*zip(*wins), marker="*", s=120, color="crimson", zorder=5)
        if not series:
            ax.text(0.5, 0.5, "no valid measurement", transform=ax.transAxes, ha="center",
                    va="center", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ctx = sorted({w.context_len for w in bviews})
        ax.set_xticks(ctx, [_k(c) for c in ctx])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        lo, hi = ax.get_ylim()
        if hi / lo < 2:        # less than one labelled tick: widen around the data
            mid = math.sqrt(lo * hi)
            ax.set_ylim(mid / 1.6, mid * 1.6)
        ax.set_title(f"kernel time vs context length, batch {b}{_q_note(q_lens)}", fontsize=10)
        ax.set_xlabel("context length (KV tokens per request)")
        ax.set_ylabel("median kernel time (us)")
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=colors[k], lw=_lw(on_page[k], always_default[k]),
                      ls="--" if always_default[k] else "-", alpha=1.0 if on_page[k] else 0.35,
                      marker="o", ms=3,
                      label=f"{k[0]}: {_series_label(k[1])}" + (" (default)" if always_default[k] else ""))
               for k in keys]
    handles.append(Line2D([], [], color="crimson", marker="*", ls="", ms=11,
                          label="winner of the bucket"))
    if any(not always_default[k] and any(c.is_default for c in lines if (c.family, _series_key(c)) == k)
           for k in keys):
        handles.append(Line2D([], [], marker="o", ls="", ms=6, markerfacecolor="none",
                              markeredgecolor="black", label="family default at that context"))
    if m.page_size is not None and not all(on_page.values()):
        handles.append(Line2D([], [], color="grey", alpha=0.35, lw=1,
                              label=f"faint: page size other than the chosen {m.page_size}"))
    sf.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=8)


def _series_key(c: CandidateLine) -> tuple:
    """A kernel configuration across contexts: the candidate without the default marker."""
    return (c.family, c.backend, c.page_size,
            tuple(sorted((k, v) for k, v in c.params.items() if k != "rule")))


def _series_label(key: tuple) -> str:
    _, backend, page, knobs = key
    return f"{backend} p{page}" + (" " + ",".join(f"{k}={v}" for k, v in knobs) if knobs else "")


def _lw(on_page: bool, default: bool) -> float:
    return (2.2 if default else 1.3) if on_page else 0.9


def _page(m) -> str:
    return f"page {m.page_size}" if m.page_size is not None else "no page chosen (nothing valid)"


def _q_note(q_lens: list) -> str:
    """Panels show the smallest q_len; say so when the entry has others."""
    if len(q_lens) == 1:
        return "" if q_lens[0] == 1 else f", q_len {q_lens[0]}"
    return f", q_len {q_lens[0]} (q_len {', '.join(map(str, q_lens[1:]))} not plotted)"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _grid(m, views):
    q = min(w.q_len for w in views)
    batches = sorted({w.batch_size for w in views if w.q_len == q})
    contexts = sorted({w.context_len for w in views if w.q_len == q})
    cell = {(w.batch_size, w.context_len): w for w in views if w.q_len == q}
    return q, batches, contexts, cell


def _label_missing(ax, batches, contexts, cell) -> None:
    for i, b in enumerate(batches):
        for j, c in enumerate(contexts):
            if (b, c) not in cell:
                ax.text(j, i, "not measured", ha="center", va="center", fontsize=7, color="#666666")


def _winner_line(w):
    return next((c for c in w.lines if c.winner), None)


def _winner_heatmap(ax, m, views) -> None:
    import matplotlib.colors as mcolors
    import numpy as np

    _, batches, contexts, cell = _grid(m, views)
    winners = sorted({c.candidate for w in views for c in w.lines if c.winner})
    idx = {k: i for i, k in enumerate(winners)}
    data = np.full((len(batches), len(contexts)), np.nan)
    for (b, c), w in cell.items():
        win = _winner_line(w)
        if win is not None:
            data[batches.index(b), contexts.index(c)] = idx[win.candidate]
    import matplotlib
    base = matplotlib.colormaps["tab10"]
    cmap = mcolors.ListedColormap([base(i % 10) for i in range(max(1, len(winners)))]).with_extremes(
        bad="#dddddd")
    ax.imshow(data, cmap=cmap, vmin=-0.5, vmax=max(0.5, len(winners) - 0.5), aspect="auto",
              origin="lower")
    for (b, c), w in cell.items():
        win = _winner_line(w)
        text = "no valid\ncandidate" if win is None else (
            f"{_short_label(win)}\n"
            + (f"{win.speedup_vs_default:.2f}x vs default" if win.speedup_vs_default else ""))
        ax.text(contexts.index(c), batches.index(b), text, ha="center", va="center", fontsize=7)
    _label_missing(ax, batches, contexts, cell)
    ax.set_xticks(range(len(contexts)), [_k(c) for c in contexts])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("context length")
    ax.set_ylabel("batch size")
    qs = _q_note(sorted({w.q_len for w in views}))
    ax.set_title(f"winner per bucket ({_page(m)}{qs}): candidate, speedup over its family default",
                 fontsize=10)


def _roofline_heatmap(ax, m, views, dev) -> None:
    import numpy as np

    _, batches, contexts, cell = _grid(m, views)
    data = np.full((len(batches), len(contexts)), np.nan)
    for (b, c), w in cell.items():
        win = _winner_line(w)
        if win is not None and win.pct_roofline is not None:
            data[batches.index(b), contexts.index(c)] = win.pct_roofline
    _label_missing(ax, batches, contexts, cell)
    ax.set_xlabel("context length")
    ax.set_ylabel("batch size")
    ax.set_xticks(range(len(contexts)), [_k(c) for c in contexts])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    if np.isnan(data).all():
        ax.imshow(np.zeros_like(data), cmap="Greys", vmin=0, vmax=1, aspect="auto", origin="lower")
        has_ceilings = any(r.get("copy_gbps") and r.get("matmul_tflops") for r in dev.runs)
        why = ("no valid winner to compare with the floor" if has_ceilings else
               "no copy/matmul ceilings recorded for these runs\n(% of roofline needs a GPU run)")
        ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", fontsize=9)
        ax.set_title("winner's % of roofline floor: not available", fontsize=10)
        return
    im = ax.imshow(data, cmap="viridis", vmin=0, vmax=max(100.0, float(np.nanmax(data))),
                   aspect="auto", origin="lower")
    for (b, c), w in cell.items():
        win = _winner_line(w)
        if win is not None and win.pct_roofline is not None:
            v = win.pct_roofline
            ax.text(contexts.index(c), batches.index(b), f"{v:.0f}%\n{w.bound or ''}", ha="center",
                    va="center", fontsize=7, color="white" if v < 60 else "black")
    ax.figure.colorbar(im, ax=ax, label="% of roofline floor")
    ceil = next(((r.get("copy_gbps"), r.get("matmul_tflops")) for r in dev.runs
                 if r.get("copy_gbps")), (None, None))
    src = f" (copy {ceil[0]:.0f} GB/s, matmul {ceil[1]:.0f} TFLOP/s)" if ceil[0] and ceil[1] else ""
    ax.set_title(f"winner's % of roofline floor{src}", fontsize=10)
