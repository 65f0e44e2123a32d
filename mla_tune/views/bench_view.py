"""`mla-tune bench` for people: its measurements (or, with --dry-run, its plan) in the read formats
of `mla_tune.views.render`."""

from __future__ import annotations

from mla_tune.problem.units import us
from mla_tune.views.render import Column, OutputFormat, Table, render, to_csv

BENCH_CPU_NOTE = ("CPU torch reference: the correctness oracle's timings on this CPU, not a "
                  "kernel's; they swing by orders of magnitude between runs and decide nothing")


def _pct(v) -> str:
    return f"{v * 100:.1f}%"


def _status(r: dict) -> str:
    if r["status"] == "ok":
        return "ok"
    first = (r.get("message") or "").strip().splitlines()
    return f"{r['invalid_reason']}: {first[0][:60]}" if first else str(r["invalid_reason"])


BENCH_COLUMNS = [Column("workload", justify="left"), Column("candidate", justify="left"),
                 Column("median us", us), Column("spread", _pct), Column("% floor", ".0f"),
                 Column("GB/s", ".0f"), Column("TFLOP/s", ".0f"), Column("plan us", us),
                 Column("compile s", ".2f"), Column("rel err", ".1e"),
                 Column("status", justify="left", wrap=True)]


def bench_tables(outcome) -> list[Table]:
    ceil = outcome.ceilings
    title = f"mla-tune bench on {outcome.device}" + (
        f" (copy {ceil['copy_gbps']:.0f} GB/s, matmul {ceil['matmul_tflops']:.0f} TFLOP/s)"
        if ceil else "")
    t = Table(title, BENCH_COLUMNS,
              caption=BENCH_CPU_NOTE if not outcome.device.startswith("cuda") else
              "spread = interquartile range / median; % floor = 100 x roofline floor / median")
    for r in outcome.rows:
        t.add(r["workload"], r["candidate"], r["median_us"], r["spread"], r.get("pct_floor"),
              r.get("gbps"), r.get("tflops"), r["plan_us"], r["compile_s"], r["max_rel_error"],
              _status(r))
    return [t]


def render_bench(outcome, fmt: str | OutputFormat) -> str | list:
    cols = ["workload", "candidate", "status", "invalid_reason", "n", "median_us", "spread",
            "min_us", "pct_floor", "gbps", "tflops", "plan_us", "compile_s", "max_rel_error"]

    def csv_text() -> str:
        t = Table("bench", [Column(c) for c in cols])
        for r in outcome.rows:
            t.add(*[r.get(c) for c in cols])
        return to_csv(t)

    return render(fmt, lambda: bench_tables(outcome), f"mla-tune bench on {outcome.device}",
                  outcome.to_json, csv_text)


def bench_plan_tables(candidates, workloads, device: str, samples: int, rounds: int,
                      db) -> list[Table]:
    """--dry-run: what a bench would measure and where it would store it."""
    store = f"stored in {db}" if db is not None else "not stored (--no-store)"
    t = Table(f"mla-tune bench --dry-run on {device}: {len(candidates)} candidate(s) x "
              f"{len(workloads)} workload(s), {samples} samples each in {rounds} rounds, {store}",
              [Column("workload", justify="left"), Column("heads"), Column("batch"),
               Column("context"), Column("q"), Column("candidates", justify="left", wrap=True)],
              caption="dry run: nothing measured, nothing written")
    keys = ", ".join(c.key for c in candidates)
    for w in workloads:
        t.add(w.label(), w.num_heads, w.batch_size, w.context_len, w.q_len, keys)
    return [t]
