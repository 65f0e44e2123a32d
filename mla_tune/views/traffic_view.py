"""What a tuned config gives a server's recorded traffic (`mla-tune report --traffic`, `doctor
--traffic`): every recorded decode step looked up as the plugin looks it up
(`ModelEntry.lookup`), served by the kernel the plugin serves there, and timed by the measured
time of the bucket it snaps to (the sweep's results.db timings, as the config carries them).

* expected per-step attention time (one MLA layer call): tuned = the served kernel's measured time
  in the step's bucket; untuned = FlashInfer's device default (what FLASHINFER_MLA plans with no
  tuned config) measured in the same bucket at the entry's page size. Averaged over the steps
  whose bucket has both times;
* coverage: the share of steps outside every tuned bucket (beyond the tuned batch range, or the
  snapped batch's context range, by more than the half grid step a lookup snaps across; or at a
  q_len no bucket has) and the share more than one log2 grid step from the bucket
  they snap to (either way the bucket's choice was measured for another shape).

The per-step time is a model: a step costs what its nearest measured bucket cost. It is only as
good as the buckets are near the steps, which is what the coverage says.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mla_tune.store.traffic import ModelTraffic, grid_steps
from mla_tune.validate import InputError
from mla_tune.views.plot import write_png
from mla_tune.views.render import Column, OutputFormat, Table, render, times, to_csv
from vllm_metax.core import choices, decisions, tuned_config as tc
from vllm_metax.core.serving import describe_dims
from vllm_metax.core.traffic import bin_center
from vllm_metax.core.tuned_config import ModelEntry

FAR_STEPS = 1.0            # grid steps (octaves) from a bucket beyond which its choice is a guess
WARN_SHARE = 0.10          # doctor warns when more of the steps than this are outside or far

@dataclass(frozen=True)
class BucketLoad:
    """The recorded steps one tuned bucket serves."""

    batch_size: int
    context_len: int
    q_len: int
    steps: int
    kernel: str
    tuned_us: float | None
    untuned_us: float | None
    far_steps: int                  # of `steps`, those more than FAR_STEPS from this bucket


@dataclass(frozen=True)
class PrefillLoad:
    """The recorded prefill plans under the entry's prefill section: expected time per plan of
    the tuned backend against the device default in the bucket each plan snaps to (same plan
    kind), and the plans more than FAR_STEPS from it or of a kind with no tuned bucket."""

    plans: int
    far: int
    timed: int
    tuned_us: float | None
    untuned_us: float | None


@dataclass(frozen=True)
class TrafficReport:
    traffic: str
    model: str
    config: str
    page_size: int
    backend: str                    # the attention backend the entry puts first
    steps: int
    outside: int                    # steps outside every tuned bucket
    far: int                        # steps more than FAR_STEPS from their bucket (outside included)
    timed: int                      # steps whose bucket has a tuned and an untuned time
    tuned_us: float | None          # expected per-step time over the timed steps
    untuned_us: float | None
    buckets: tuple = field(default_factory=tuple)      # BucketLoad, most steps first
    prefill: "PrefillLoad | None" = None               # the recorded prefill plans, if any

    @property
    def speedup(self) -> float | None:
        return self.untuned_us / self.tuned_us if self.tuned_us and self.untuned_us else None

    @property
    def outside_share(self) -> float:
        return self.outside / self.steps if self.steps else 0.0

    @property
    def far_share(self) -> float:
        return self.far / self.steps if self.steps else 0.0

    def warning(self, share: float = WARN_SHARE) -> str | None:
        """One line where too many steps fall outside the tuned buckets or far from them."""
        if self.far_share <= share:
            return None
        return (f"{100 * self.far_share:.1f}% of the recorded steps are outside the tuned buckets "
                f"or more than {FAR_STEPS:g} grid step from the nearest ({100 * self.outside_share:.1f}% "
                f"outside): re-tune for this traffic (`mla-tune sweep --traffic {self.traffic}`)")

    def to_json(self) -> dict:
        return {**asdict(self), "speedup": self.speedup, "outside_share": self.outside_share,
                "far_share": self.far_share}

    def tables(self) -> list[Table]:
        us = ".1f"
        pct = lambda v: f"{100 * v:.1f}%"        # noqa: E731
        head = Table(f"Traffic {self.traffic} ({self.model}) under {self.config}",
                     [Column("steps"), Column("tuned us/step", us), Column("untuned us/step", us),
                      Column("untuned/tuned", times), Column("timed", pct), Column("outside", pct),
                      Column("> 1 grid step", pct)],
                     caption=(f"per MLA layer call, each step timed by the bucket it snaps to; "
                              f"untuned: FlashInfer's device default at page {self.page_size}; "
                              f"the config serves {self.backend} first"))
        head.add(self.steps, self.tuned_us, self.untuned_us, self.speedup,
                 self.timed / self.steps if self.steps else 0.0, self.outside_share, self.far_share)
        p = self.prefill
        if p is not None:
            head.caption += (f"; prefill: {p.plans} plans, "
                             + (f"{p.tuned_us:.1f} us a plan tuned, {p.untuned_us:.1f} untuned, "
                                if p.timed else "no tuned prefill bucket timed, ")
                             + f"{100 * p.far / p.plans:.1f}% outside or > 1 grid step from the "
                               "tuned prefill buckets")
        per = Table("Tuned buckets by recorded steps",
                    [Column("batch"), Column("context"), Column("q_len"), Column("steps", pct),
                     Column("kernel", justify="left"), Column("tuned us", us),
                     Column("untuned us", us), Column("far", pct)])
        for b in self.buckets:
            per.add(b.batch_size, b.context_len, b.q_len, b.steps / self.steps, b.kernel,
                    b.tuned_us, b.untuned_us, b.far_steps / b.steps if b.steps else 0.0)
        return [head, per]

    def render(self, fmt: str | OutputFormat) -> str | list:
        return render(fmt, self.tables, "Traffic report", self.to_json,
                      lambda: "".join(to_csv(t) for t in self.tables()))


def _served(entry: ModelEntry, bucket) -> tuple[str, float | None]:
    """(kernel name, measured time) of what the plugin serves in `bucket` under `entry`: what a
    step at the bucket's own key runs (`decisions.decode_kernel`)."""
    step = decisions.DecodeStep(bucket.batch_size, bucket.context_len, bucket.q_len)
    fam = decisions.decode_kernel(entry, step).family
    fc = bucket.families.get(fam)
    if fam != choices.FLASHINFER:
        return fam, fc.time_us if fc is not None else None
    name = fam if fam != choices.FLASHINFER or fc is None else f"flashinfer {fc.params.get('backend', '')}"
    return name.strip(), fc.time_us if fc is not None else None


def _hull(entry: ModelEntry) -> dict:
    """Per q_len the tuned batch range, and per (q_len, batch) the tuned context range."""
    out: dict = {}
    for b in entry.buckets:
        for key, v in (((b.q_len,), b.batch_size), ((b.q_len, b.batch_size), b.context_len)):
            lo, hi = out.get(key, (v, v))
            out[key] = (min(lo, v), max(hi, v))
    return out


def _inside(hull: dict, bucket, batch: int, context: int) -> bool:
    """Whether a step lies within the tuned grid: its batch within the q_len's tuned batches and
    its context within the snapped batch's tuned contexts, each widened by the half grid step a
    lookup snaps across at the edge."""
    def within(v, lo_hi):
        return lo_hi[0] / 2 ** 0.5 <= v <= lo_hi[1] * 2 ** 0.5
    return (within(batch, hull[(bucket.q_len,)])
            and within(context, hull[(bucket.q_len, bucket.batch_size)]))


def traffic_report(traffic: ModelTraffic, entry: ModelEntry, config_path: str = "") -> TrafficReport:
    """The recorded decode steps of `traffic` looked up, served and timed under `entry`."""
    loads: dict = {}
    outside = far = timed = 0
    tuned = untuned = 0.0
    hull = _hull(entry)
    for d in traffic.decode:
        found = entry.lookup(d.batch_size, d.context, d.q_len)
        if found is None:
            continue
        b = found.bucket
        out = b.q_len != d.q_len or not _inside(hull, b, d.batch_size, d.context)
        is_far = out or grid_steps(d.batch_size, b.batch_size) > FAR_STEPS \
            or grid_steps(d.context, b.context_len) > FAR_STEPS
        outside += d.steps * out
        far += d.steps * is_far
        key = (b.batch_size, b.context_len, b.q_len)
        if key not in loads:
            kernel, t = _served(entry, b)
            fi = b.families.get(choices.FLASHINFER)
            loads[key] = [kernel, t, fi.default_time_us if fi is not None else None, 0, 0]
        row = loads[key]
        row[3] += d.steps
        row[4] += d.steps * is_far
        if row[1] and row[2]:
            timed += d.steps
            tuned += d.steps * row[1]
            untuned += d.steps * row[2]
    rows = sorted((BucketLoad(*k, v[3], v[0], v[1], v[2], v[4]) for k, v in loads.items()),
                  key=lambda r: (-r.steps, r.q_len, r.batch_size, r.context_len))
    return TrafficReport(traffic.path, traffic.label, config_path or "-", entry.page_size,
                         entry.backend_order[0] if entry.backend_order else "-",
                         traffic.steps, outside, far, timed,
                         tuned / timed if timed else None, untuned / timed if timed else None,
                         tuple(rows), prefill_load(traffic, entry))


def prefill_load(traffic: ModelTraffic, entry: ModelEntry) -> PrefillLoad | None:
    """The recorded prefill plans looked up in the entry's prefill section (None: none recorded)."""
    if not traffic.prefill:
        return None
    far = timed = 0
    tuned = untuned = 0.0
    for p in traffic.prefill:
        q, kv = bin_center(p.query_bin), bin_center(p.kv_bin)
        b = entry.prefill_lookup(p.causal, q, kv)
        if b is None or grid_steps(q, b.query_tokens) > FAR_STEPS or grid_steps(kv, b.kv_len) > FAR_STEPS:
            far += p.plans
        if b is not None and b.time_us and b.default_time_us:
            timed += p.plans
            tuned += p.plans * b.time_us
            untuned += p.plans * b.default_time_us
    return PrefillLoad(traffic.plans, far, timed, tuned / timed if timed else None,
                       untuned / timed if timed else None)


def entry_for_traffic(config, traffic: ModelTraffic) -> ModelEntry:
    """The config's entry the server ran the traffic's model with (same model key); InputError
    naming the entries when none has it."""
    for m in config.models:
        if m.dims == traffic.dims:
            return m
    have = "; ".join(describe_dims(m.dims) for m in config.models) or "none"
    raise InputError(f"{config.path or 'the tuned config'} has no entry for the traffic's model "
                     f"({describe_dims(traffic.dims)}); it has: {have}")


def config_for_traffic(traffic_device: str | None, config_path=None):
    """The tuned config a report compares: `config_path` where given, else the one the plugin
    loads for the traffic's device (`resolve_tuned_config`). InputError when there is none."""
    if config_path is not None:
        return tc.read_tuned_config(config_path)
    if not traffic_device:
        raise InputError("the traffic file does not name its device: name the config with --config")
    res = tc.resolve_tuned_config(traffic_device)
    if res.config is None:
        raise InputError(f"no tuned config to compare for {traffic_device!r} ({res.reason}): name "
                         "one with --config")
    return res.config


def traffic_figure(traffic: ModelTraffic, entry: ModelEntry | None = None):
    """The traffic's decode steps as a (batch, context) density on log2 axes, one panel per
    q_len (the most recorded first, at most three), the entry's tuned buckets of that q_len
    overlaid (x)."""
    import matplotlib       # lazy: a report without a plot never loads matplotlib and numpy
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    import numpy as np

    by_q: dict = {}
    for d in traffic.decode:
        by_q.setdefault(d.q_len, []).append(d)
    qs = sorted(by_q, key=lambda q: -sum(d.steps for d in by_q[q]))[:3]
    if not qs:
        raise InputError(f"{traffic.path}: no decode step recorded for {traffic.label}: nothing to plot")
    fig, axes = plt.subplots(1, len(qs), figsize=(5.5 * len(qs), 4.6), squeeze=False,
                             layout="constrained")
    for ax, q in zip(axes[0], qs):
        ds = by_q[q]
        x = np.log2([d.batch_size for d in ds])
        y = np.log2([d.context for d in ds])
        w = np.array([d.steps for d in ds], dtype=float)
        xb = np.arange(np.floor(x.min()) - 0.5, np.ceil(x.max()) + 0.75, 0.25)
        yb = np.arange(np.floor(y.min()) - 0.5, np.ceil(y.max()) + 0.75, 0.25)
        h = ax.hist2d(x, y, bins=[xb, yb], weights=w, cmap="viridis", norm=LogNorm(), cmin=1)
        fig.colorbar(h[3], ax=ax, label="decode steps")
        if entry is not None:
            tb = [b for b in entry.buckets if b.q_len == q]
            if tb:
                ax.scatter(np.log2([b.batch_size for b in tb]), np.log2([b.context_len for b in tb]),
                           marker="x", color="red", s=40, label="tuned buckets")
                ax.legend(loc="upper right", fontsize=8)
            else:
                ax.text(0.02, 0.98, f"no tuned bucket at q_len {q}", transform=ax.transAxes,
                        va="top", fontsize=9, color="red")
        ax.set_xlabel("batch size (log2)")
        ax.set_ylabel("mean context (log2)")
        share = 100 * w.sum() / max(1, traffic.steps)
        ax.set_title(f"q_len {q}: {int(w.sum())} steps ({share:.0f}%)", fontsize=10)
    fig.suptitle(f"{traffic.path} · {traffic.label}", fontsize=10)
    return fig


def plot_traffic(traffic: ModelTraffic, entry: ModelEntry | None, path, dpi: int = 110):
    """Write `traffic_figure` to a PNG (a new file or an earlier plot only); returns the path."""
    return write_png(path, lambda: traffic_figure(traffic, entry), dpi)


__all__ = ["BucketLoad", "FAR_STEPS", "PrefillLoad", "prefill_load", "TrafficReport", "WARN_SHARE", "config_for_traffic",
           "entry_for_traffic", "plot_traffic", "traffic_figure", "traffic_report"]
