"""`mla-tune bench`: parse the flags, call mla_tune.tune.bench, print its view
(mla_tune.views.bench_view) in the read formats every command shares."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

from mla_tune.cli.app import UserError, app, console, err_console, given, print_view
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


@app.command("bench", help=HELP, short_help="Measure given candidates directly, no search.",
             epilog="Exit codes: 0 measured; 2 bad input (nothing is written then).")
def bench(
    ctx: typer.Context,
    candidates: List[str] = typer.Argument(..., metavar="CANDIDATE...",
                                           help="family/backend/p<page>[/knob=value], e.g. "
                                                "flashinfer/fa3/p64"),
    model: str = typer.Option("deepseek-v3", help="Model preset (mla_tune/problem/models.json)"),
    heads: Optional[int] = typer.Option(None, help="Custom model with this many heads per rank (R=512, P=64) instead of --model/--tp",
                                        **INT["heads"].typer),
    tp: Optional[int] = typer.Option(None, help="Tensor-parallel size: heads per rank = model "
                                     "heads / tp (default: GPU 1, CPU 8)", **INT["tp"].typer),
    batches: Optional[str] = typer.Option(None, "--batches", "--batch", help="Batch sizes: "
                                          "'1,4,16' or '1-128' (powers of two; default: GPU 32, "
                                          "CPU 1)"),
    contexts: Optional[str] = typer.Option(None, "--contexts", "--context", help="Context lengths "
                                           "(KV tokens per request): '1024,4K' or '1K-32K' "
                                           "(default: GPU 4096, CPU 1024)"),
    q_len: int = typer.Option(1, "--q-len", help="Query tokens per request (>1: speculative decode, causal)",
                              **INT["q_len"].typer),
    lengths: str = typer.Option("uniform", "--lengths", "--ragged", help="Per-request context "
                                "lengths: uniform, uniform-random, lognormal"),
    samples: Optional[int] = typer.Option(None, help="Kernel samples per candidate (default: "
                                          "GPU 100, CPU 10)", **INT["bench_samples"].typer),
    rounds: int = typer.Option(5, help="Interleaving rounds (samples are split over them)", **INT["rounds"].typer),
    warmup: int = typer.Option(5, help="Warm-up runs after compile", **INT["warmup"].typer),
    plan_samples: int = typer.Option(50, help="Host plan() samples per candidate", **INT["plan_samples"].typer),
    device: Optional[Device] = typer.Option(None, help="cuda or cpu (default: cuda when available)"),
    check: bool = typer.Option(True, help="Correctness gate against the torch reference"),
    ceilings: bool = typer.Option(True, help="Measure copy/matmul ceilings for %-of-floor (CUDA only)"),
    db: Optional[Path] = PathOption(None, "--db", metavar="DB", help="Results DB to store trials "
                                    "in (default: results.db; without CUDA results-cpu.db)"),
    no_store: bool = typer.Option(False, "--no-store", help="Do not write the results DB"),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f",
                                        help="Output: table, json, csv or markdown",
                                        case_sensitive=False),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the flags and print what would "
                                 "be measured and where it would be stored; measure nothing"),
):
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.store.results import is_results_db
    from mla_tune.tune.bench import (bench_defaults, bench_device, bench_workloads, gpu_settings,
                                     parse_candidates, run_bench)
    from mla_tune.tune.buckets import default_db
    from mla_tune.tune.sweep import parse_sizes     # the one size-list rule, sweep's syntax
    from mla_tune.validate import check_kv_tokens, output_file
    from mla_tune.views.bench_view import bench_plan_tables, render_bench

    if heads is not None and given(ctx, "model", "tp"):
        raise UserError(f"--heads replaces --model/--tp; drop {', '.join('--' + n for n in given(ctx, 'model', 'tp'))}")
    if no_store and given(ctx, "db"):
        raise UserError("--no-store and --db exclude each other")
    cands = parse_candidates(candidates)
    dev = bench_device(device.value if device is not None else None)
    d = bench_defaults(dev)
    samples = samples if samples is not None else d.samples
    if samples < rounds and given(ctx, "rounds"):
        raise UserError(f"--samples {samples} cannot be split over --rounds {rounds}")
    rounds = min(rounds, samples)
    try:
        batch_list = parse_sizes(batches if batches is not None else d.batches, "batch")
        context_list = parse_sizes(contexts if contexts is not None else d.contexts, "context")
    except ValueError as e:     # parse_sizes (sweep.py) raises plain ValueErrors
        raise UserError(f"--batches/--contexts: {e}") from None
    check_kv_tokens(max(batch_list), max(context_list))
    workloads = bench_workloads(model, heads, tp if tp is not None else d.tp, batch_list,
                                context_list, q_len, lengths)
    store_db = None if no_store else (db if db is not None else default_db(dev))
    if store_db is not None:
        output_file(store_db, "--db", own=is_results_db)
    if not dev.startswith("cuda") and given(ctx, "ceilings"):
        raise UserError("--ceilings/--no-ceilings apply to CUDA only")
    if dry_run:
        from mla_tune.views.render import render
        print_view(render(format, lambda: bench_plan_tables(cands, workloads, dev, samples, rounds,
                                                            store_db),
                          "mla-tune bench --dry-run",
                          lambda: {"device": dev, "db": None if store_db is None else str(store_db),
                                   "samples": samples, "rounds": rounds,
                                   "candidates": [c.key for c in cands],
                                   "workloads": [w.label() for w in workloads]},
                          lambda: "workload,candidate\n" + "".join(
                              f"{w.label()},{c.key}\n" for w in workloads for c in cands)))
        return
    settings = MeasureSettings(device=dev, warmup=warmup, samples=samples, plan_samples=plan_samples,
                               check=check)
    ceil = gpu_settings(settings, ceilings) if dev.startswith("cuda") else None
    from mla_tune.cli.progress import progress_for
    progress = progress_for(err_console, "bench", len(workloads), "workloads")

    def on_workload(done, total, w):
        progress.update(done, note=w.label() if w is not None else "done")

    try:
        outcome = run_bench(cands, workloads, settings, rounds, store_db, ceil,
                            command="mla-tune bench " + " ".join(candidates),
                            on_workload=on_workload)
    finally:
        progress.close()
    print_view(render_bench(outcome, format))
    if store_db is not None:
        err_console.print(f"stored {len(outcome.rows)} trial(s) in {store_db}", highlight=False)
