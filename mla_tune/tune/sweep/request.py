"""A SweepConfig from command-line style values (what `mla-tune sweep` parses), the device's
defaults filling the gaps, and the one-line estimate of what a plan will measure."""

from __future__ import annotations

from typing import Sequence

from mla_tune.problem.workload import DTYPES, model_preset
from mla_tune.tune.sweep.buckets import (default_db, default_space, detect_device, measure_settings,
                                   parse_duration, parse_sizes, plan_buckets, resolve_lengths)
from mla_tune.tune.sweep.config import SweepConfig
from mla_tune.tune.sweep.plan import SweepPlan


def build_config(*, model: str = "deepseek-v3", tp_sizes: Sequence[int] | None = None,
                 batches: str | None = None, contexts: str | None = None,
                 q_lens: Sequence[int] = (1,), ragged: str | None = None, q_dtype: str = "bfloat16",
                 kv_dtype: str = "bfloat16", page_sizes: Sequence[int] | None = None,
                 device: str | None = None, samples: int | None = None, warmup: int | None = None,
                 timeout_s: float | None = None, time_budget: str | None = None,
                 cells: Sequence[tuple[int, int, int]] | None = None, **kw) -> SweepConfig:
    """A SweepConfig from command-line style values, device defaults filling the gaps (results
    DB: default_db(device); tuned config emitted on a GPU only, unless `emit` says).

    `ragged` (--lengths) is a length distribution or a CSV file of request lengths
    (resolve_lengths); None is uniform lengths, plus the device's default ragged buckets
    (DefaultSpace.ragged) when the grid is the default one too.

    `cells` ((batch, context, q_len), a recorded traffic's: `traffic_plan.decode_plan`) replace
    the batch x context x q_len grid.

    Raises ValueError / ProblemError with a one-line message for anything invalid.
    """
    device = device or detect_device()
    if kw.get("db") is None:
        kw["db"] = default_db(device)
    d = default_space(device)
    dims = model_preset(model)
    kind, trace = resolve_lengths(ragged) if ragged is not None else ("uniform", None)
    for dt in (q_dtype, kv_dtype):
        if dt not in DTYPES:
            raise ValueError(f"unsupported dtype {dt!r}; one of {', '.join(DTYPES)}")
    from mla_tune.validate import check_int, check_page_size
    for q in q_lens:
        check_int("q_len", q, "--q-len")
    for t in tp_sizes or ():
        check_int("tp", t, "--tp")
    pages = tuple(page_sizes) if page_sizes else d.page_sizes
    for p in pages:
        check_page_size(p, "--page-size")
    tps = tuple(tp_sizes) if tp_sizes else d.tp_sizes
    qs = tuple(sorted(set(q_lens))) or (1,)
    if cells is not None:
        buckets = [bk for b, c, q in cells
                   for bk in plan_buckets(dims, tps, [b], [c], [q], kind, q_dtype, kv_dtype, trace)]
    else:
        buckets = plan_buckets(dims, tps,
                               parse_sizes(batches, "batch") if batches is not None else d.batch_sizes,
                               parse_sizes(contexts, "context") if contexts is not None else d.context_lens,
                               qs, kind, q_dtype, kv_dtype, trace)
    if ragged is None and batches is None and contexts is None and cells is None:
        for extra_kind, extra_b, extra_c in d.ragged:
            buckets += plan_buckets(dims, tps, extra_b, extra_c, qs, extra_kind, q_dtype, kv_dtype)
    s = samples if samples is not None else d.samples
    if s < 2:
        raise ValueError(f"--samples must be >= 2 (the significance test needs samples), got {s}")
    settings = measure_settings(device, s, warmup if warmup is not None else d.warmup)
    if warmup is not None:
        check_int("warmup", warmup, "--warmup")
    budget = parse_duration(time_budget) if time_budget is not None else d.time_budget_s
    timeout = timeout_s if timeout_s is not None else d.timeout_s
    from mla_tune.validate import check_float
    check_float("timeout", timeout, "--timeout")
    check_float("time_budget", budget, "--time-budget")
    return SweepConfig(buckets=buckets, page_sizes=pages, device=device, settings=settings,
                       timeout_s=timeout, time_budget_s=budget, **kw)


def estimate_note(plan: SweepPlan) -> str:
    """One line: buckets, candidates, modes."""
    n = len(plan.buckets)
    sizes = [len(p.space) for p in plan.buckets]
    modes = sorted({p.mode for p in plan.buckets})
    dropped = sum(len(p.space.dropped) for p in plan.buckets)
    lo, hi = min(sizes, default=0), max(sizes, default=0)
    return (f"{n} buckets, {lo if lo == hi else f'{lo}-{hi}'} candidates each, "
            f"search {'/'.join(modes) or '-'}, up to {plan.planned_trials} trials"
            + (f" ({dropped} dropped by constraints)" if dropped else ""))


__all__ = ["build_config", "estimate_note"]
