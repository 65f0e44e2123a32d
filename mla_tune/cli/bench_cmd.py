"""`mla-tune bench`: parse the flags, call mla_tune.tune.bench, print the table or JSON."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

from mla_tune.cli.app import UserError, app, console, given
from mla_tune.validate import INT, PathOption


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


class BenchFormat(str, Enum):
    table = "table"
    json = "json"


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


@app.command("bench")
def bench(
    ctx: typer.Context,
    candidates: List[str] = typer.Argument(..., help="Candidates as family/backend/p<page>[/k=v], e.g. flashinfer/fa3/p64"),
    model: str = typer.Option("deepseek-v3", help="Model preset (mla_tune/problem/models.json)"),
    heads: Optional[int] = typer.Option(None, help="Custom model with this many heads per rank (R=512, P=64) instead of --model/--tp",
                                        **INT["heads"].typer),
    tp: int = typer.Option(1, help="Tensor-parallel size: heads per rank = model heads / tp", **INT["tp"].typer),
    batch: str = typer.Option("32", help="Batch sizes: '1,4,16' or '1-128' (powers of two)"),
    context: str = typer.Option("4096", help="Context lengths (KV tokens per request): '1024,4K' or '1K-32K'"),
    q_len: int = typer.Option(1, "--q-len", help="Query tokens per request (>1: speculative decode, causal)",
                              **INT["q_len"].typer),
    ragged: str = typer.Option("uniform", help="Length distribution: uniform, uniform-random, lognormal"),
    samples: int = typer.Option(100, help="Kernel samples per candidate", **INT["bench_samples"].typer),
    rounds: int = typer.Option(5, help="Interleaving rounds (samples are split over them)", **INT["rounds"].typer),
    warmup: int = typer.Option(5, help="Warm-up runs after compile", **INT["warmup"].typer),
    plan_samples: int = typer.Option(50, help="Host plan() samples per candidate", **INT["plan_samples"].typer),
    device: Optional[Device] = typer.Option(None, help="cuda or cpu (default: cuda when available)"),
    check: bool = typer.Option(True, help="Correctness gate against the torch reference"),
    ceilings: bool = typer.Option(True, help="Measure copy/matmul ceilings for %-of-floor (CUDA only)"),
    db: Path = PathOption(Path("results.db"), help="Results DB to store trials in"),
    no_store: bool = typer.Option(False, "--no-store", help="Do not write the results DB"),
    format: BenchFormat = typer.Option(BenchFormat.table, "--format", help="table or json"),
):
    """Measure the given candidates directly (no search) and print median, spread, % of floor, plan time."""
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.store.results import is_results_db
    from mla_tune.tune.bench import (bench_device, bench_workloads, gpu_settings, parse_candidates,
                                     run_bench)
    from mla_tune.tune.sweep import parse_sizes     # the one size-list rule, sweep's syntax
    from mla_tune.validate import check_kv_tokens, output_file

    if heads is not None and given(ctx, "model", "tp"):
        raise UserError(f"--heads replaces --model/--tp; drop {', '.join('--' + n for n in given(ctx, 'model', 'tp'))}")
    if no_store and given(ctx, "db"):
        raise UserError("--no-store and --db exclude each other")
    if samples < rounds and given(ctx, "rounds"):
        raise UserError(f"--samples {samples} cannot be split over --rounds {rounds}")
    cands = parse_candidates(candidates)
    try:
        batches, contexts = parse_sizes(batch, "batch"), parse_sizes(context, "context")
    except ValueError as e:     # parse_sizes (sweep.py) raises plain ValueErrors
        raise UserError(f"--batch/--context: {e}") from None
    check_kv_tokens(max(batches), max(contexts))
    workloads = bench_workloads(model, heads, tp, batches, contexts, q_len, ragged)
    if not no_store:
        output_file(db, "--db", own=is_results_db)
    dev = bench_device(device.value if device is not None else None)
    if not dev.startswith("cuda") and given(ctx, "ceilings"):
        raise UserError("--ceilings/--no-ceilings apply to CUDA only")
    settings = MeasureSettings(device=dev, warmup=warmup, samples=samples, plan_samples=plan_samples,
                               check=check)
    ceil = gpu_settings(settings, ceilings) if dev.startswith("cuda") else None
    outcome = run_bench(cands, workloads, settings, rounds, None if no_store else db, ceil,
                        command="mla-tune bench " + " ".join(candidates))
    if format == BenchFormat.json:
        console.print_json(json.dumps(outcome.to_json(), default=str))
        return
    _print_table(outcome)
    if not no_store:
        console.print(f"stored {len(outcome.rows)} trial(s) in {db}")


def _print_table(outcome) -> None:
    from rich.table import Table
    ceil = outcome.ceilings
    title = f"mla-tune bench on {outcome.device}" + (
        f" (copy {ceil['copy_gbps']:.0f} GB/s, matmul {ceil['matmul_tflops']:.0f} TFLOP/s)" if ceil else "")
    t = Table(title=title)
    for col in ("workload", "candidate", "median us", "spread", "% floor", "GB/s", "TFLOP/s",
                "plan us", "compile s", "rel err", "status"):
        t.add_column(col, justify="left" if col in ("workload", "candidate", "status") else "right")
    for r in outcome.rows:
        status = "ok" if r["status"] == "ok" else f"{r['invalid_reason']}: {(r['message'] or '').splitlines()[0][:60] if r['message'] else ''}"
        t.add_row(r["workload"], r["candidate"], _fmt(r["median_us"], ".1f"),
                  _fmt(r["spread"] * 100 if r["spread"] is not None else None, ".1f") + ("%" if r["spread"] is not None else ""),
                  _fmt(r.get("pct_floor"), ".0f"), _fmt(r.get("gbps"), ".0f"), _fmt(r.get("tflops"), ".0f"),
                  _fmt(r["plan_us"], ".0f"), _fmt(r["compile_s"], ".2f"), _fmt(r["max_rel_error"], ".1e"),
                  status)
    console.print(t)
