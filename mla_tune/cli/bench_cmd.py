"""`mla-tune bench`: parse the flags, call mla_tune.tune.bench, print its view
(mla_tune.views.bench_view) in the read formats every command shares."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

from mla_tune.cli.app import (ProfileName, UserError, app, err_console, given, print_view,
                              profile_option, profile_value)
from mla_tune.views.render import OutputFormat
from mla_tune.validate import INT, PathOption


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


HELP = ("Measure the given candidates directly (no search) and print median, spread, % of "
        "floor, plan time.\n\n"
        "A candidate is family/backend/p<page>[/knob=value], e.g. flashinfer/fa3/p64 or "
        "split/triton/p64/num_splits=16/partial=bfloat16/pipe=t64. Defaults: on a GPU B32 L4096 "
        "at TP1 (128 heads), 100 samples, into results.db; without CUDA the CPU torch reference "
        "at B1 L1024 and TP8 (16 heads), 10 samples, into results-cpu.db (never results.db).")


# the arguments, in --help order (module constants keep the command itself a few lines of glue)
CANDIDATES = typer.Argument(..., metavar="CANDIDATE...", help="Family/backend/p<page>[/knob=value], "
                            "e.g. flashinfer/fa3/p64")
MODEL = typer.Option("deepseek-v3", help="Model preset (mla_tune/problem/models.json)")
HEADS = typer.Option(None, help="Custom model with this many heads per rank (R=512, P=64) instead "
                     "of --model/--tp", **INT["heads"].typer)
TP = typer.Option(None, help="Tensor-parallel size: heads per rank = model heads / tp (default: "
                  "GPU 1, CPU 8)", **INT["tp"].typer)
BATCHES = typer.Option(None, "--batches", "--batch", help="Batch sizes: '1,4,16' or '1-128' (powers "
                       "of two; default: GPU 32, CPU 1)")
CONTEXTS = typer.Option(None, "--contexts", "--context", help="Context lengths (KV tokens per "
                        "request): '1024,4K' or '1K-32K' (default: GPU 4096, CPU 1024)")
Q_LEN = typer.Option(1, "--q-len", help="Query tokens per request (>1: speculative decode, causal)",
                     **INT["q_len"].typer)
LENGTHS = typer.Option("uniform", "--lengths", "--ragged", help="Per-request context lengths: "
                       "uniform, uniform-random, lognormal")
SAMPLES = typer.Option(None, help="Kernel samples per candidate (default: GPU 100, CPU 10)",
                       **INT["bench_samples"].typer)
ROUNDS = typer.Option(5, help="Interleaving rounds (samples are split over them)", **INT["rounds"].typer)
WARMUP = typer.Option(5, help="Warm-up runs after compile", **INT["warmup"].typer)
PLAN_SAMPLES = typer.Option(50, help="Host plan() samples per candidate", **INT["plan_samples"].typer)
DEVICE = typer.Option(None, help="Device to measure on: cuda or cpu (default: cuda when available)")
CHECK = typer.Option(True, help="Correctness gate against the torch reference")
CEILINGS = typer.Option(True, help="Measure copy/matmul ceilings for %-of-floor (CUDA only)")
DB = PathOption(None, "--db", metavar="DB", help="Results DB to store trials in (default: "
                "results.db; without CUDA results-cpu.db)")
NO_STORE = typer.Option(False, "--no-store", help="Do not write the results DB")
FORMAT = typer.Option(OutputFormat.table, "--format", "-f", help="Output: table, json, csv or "
                      "markdown", case_sensitive=False)
DRY_RUN = typer.Option(False, "--dry-run", help="Check the flags and print what would be measured "
                       "and where it would be stored; measure nothing")


PROFILE = profile_option("prepare each candidate as that target runs it; one it cannot run is "
                         "stored as refused")


@app.command("bench", help=HELP, short_help="Measure given candidates directly, no search.",
             epilog="Exit codes: 0 measured; 2 bad input (nothing is written then).")
def bench(
    ctx: typer.Context, candidates: List[str] = CANDIDATES, model: str = MODEL,
    heads: Optional[int] = HEADS, tp: Optional[int] = TP, batches: Optional[str] = BATCHES,
    contexts: Optional[str] = CONTEXTS, q_len: int = Q_LEN, lengths: str = LENGTHS,
    samples: Optional[int] = SAMPLES, rounds: int = ROUNDS, warmup: int = WARMUP,
    plan_samples: int = PLAN_SAMPLES, device: Optional[Device] = DEVICE, check: bool = CHECK,
    ceilings: bool = CEILINGS, db: Optional[Path] = DB, no_store: bool = NO_STORE,
    format: OutputFormat = FORMAT, dry_run: bool = DRY_RUN, profile: Optional[ProfileName] = PROFILE,
):
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.tune.bench import plan_bench
    from mla_tune.views.bench_view import render_bench

    if heads is not None and given(ctx, "model", "tp"):
        raise UserError(f"--heads replaces --model/--tp; drop {', '.join('--' + n for n in given(ctx, 'model', 'tp'))}")
    if no_store and given(ctx, "db"):
        raise UserError("--no-store and --db exclude each other")
    plan = plan_bench(candidates, model=model, heads=heads, tp=tp, batches=batches,
                      contexts=contexts, q_len=q_len, lengths=lengths, samples=samples,
                      rounds=rounds, rounds_given=bool(given(ctx, "rounds")),
                      device=device.value if device is not None else None, db=db,
                      store=not no_store)
    if not plan.device.startswith("cuda") and given(ctx, "ceilings"):
        raise UserError("--ceilings/--no-ceilings apply to CUDA only")
    if dry_run:
        return print_view(_dry_run_view(plan, format))
    settings = MeasureSettings(device=plan.device, warmup=warmup, samples=plan.samples,
                               plan_samples=plan_samples, check=check, profile=profile_value(profile))
    outcome = _measure(plan, settings, ceilings, "mla-tune bench " + " ".join(candidates))
    print_view(render_bench(outcome, format))
    if plan.db is not None:
        err_console.print(f"stored {len(outcome.rows)} trial(s) in {plan.db}", highlight=False)


def _dry_run_view(plan, format: OutputFormat):
    """--dry-run: what would be measured and where it would be stored, in the read formats."""
    from mla_tune.views.bench_view import bench_plan_tables
    from mla_tune.views.render import render
    cands, workloads = plan.candidates, plan.workloads
    return render(format, lambda: bench_plan_tables(cands, workloads, plan.device, plan.samples,
                                                    plan.rounds, plan.db),
                  "mla-tune bench --dry-run",
                  lambda: {"device": plan.device, "db": None if plan.db is None else str(plan.db),
                           "samples": plan.samples, "rounds": plan.rounds,
                           "candidates": [c.key for c in cands],
                           "workloads": [w.label() for w in workloads]},
                  lambda: "workload,candidate\n" + "".join(
                      f"{w.label()},{c.key}\n" for w in workloads for c in cands))


def _measure(plan, settings, ceilings: bool, command: str):
    """run_bench over the plan with a progress line per workload on stderr."""
    from mla_tune.cli.progress import progress_for
    from mla_tune.tune.bench import gpu_settings, run_bench
    ceil = gpu_settings(settings, ceilings) if plan.device.startswith("cuda") else None
    progress = progress_for(err_console, "bench", len(plan.workloads), "workloads")

    def on_workload(done, total, w):
        progress.update(done, note=w.label() if w is not None else "done")

    try:
        return run_bench(plan.candidates, plan.workloads, settings, plan.rounds, plan.db, ceil,
                         command=command, on_workload=on_workload)
    finally:
        progress.close()
