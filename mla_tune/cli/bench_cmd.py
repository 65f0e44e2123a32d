"""`mla-tune bench`: measure a given list of candidates on given workloads, print the table, store
every trial (raw samples included) in the results DB."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

from mla_tune.cli.app import UserError, app, console, given
from mla_tune.validate import INT, PathOption


def bench_workloads(model: str | None, heads: int | None, tp: int, batches: list[int],
                    contexts: list[int], q_len: int, ragged: str, seed: int = 0):
    """The workloads of a bench invocation (model preset or custom head count)."""
    from mla_tune.problem.workload import custom_model, model_preset, workload_for
    dims = custom_model(heads) if heads else model_preset(model or "deepseek-v3")
    return [workload_for(dims, 1 if heads else tp, b, c, q_len, ragged, seed)
            for b in batches for c in contexts]


def run_bench(candidates, workloads, settings, rounds: int, db: str | None, ceilings: dict | None,
              command: str = "", on_progress=None) -> list[dict]:
    """Measure `candidates` on each workload (interleaved), store them, return one row per trial."""
    from mla_tune.families import get_backend
    from mla_tune.measure.environment import capture_environment
    from mla_tune.measure.trial import TrialResult, measure_interleaved
    from mla_tune.problem.roofline import achieved, pct_of_floor, workload_bytes, workload_flops
    from mla_tune.store.results import ResultsStore, stats_of

    families = {}
    for c in candidates:
        if c.family not in families:
            try:
                families[c.family] = get_backend(c.family)
            except KeyError as e:
                raise UserError(str(e).strip("'\"")) from None
    avail = {f: b.available(settings.device) for f, b in families.items()}
    store = ResultsStore(db) if db else None
    env = capture_environment("gpu" if settings.device.startswith("cuda") else "cpu-reference", command)
    env.update(ceilings or {})
    run_id = store.add_run(env) if store else None
    rows = []
    try:
        for w in workloads:
            entries = [(families[c.family], c) for c in candidates if avail[c.family].ok]
            results = measure_interleaved(entries, w, settings, rounds,
                                          on_prepared=on_progress) if entries else []
            by_key = {r.candidate.key: r for r in results}
            wid = store.workload_id(w, workload_bytes(w), workload_flops(w)) if store else None
            for c in candidates:
                r = by_key.get(c.key) or TrialResult(c, "invalid", invalid_reason="unsupported",
                                                     message=avail[c.family].reason)
                if store:
                    store.add_trial(run_id, wid, c, r.status, r.samples, r.invalid_reason,
                                    r.message, r.compile_s, r.max_rel_error, sweep="bench")
                st = stats_of(r.samples.get("kernel_us", []))
                pst = stats_of(r.samples.get("plan_us", []))
                row = {"workload": w.label(), "candidate": c.key, "status": r.status,
                       "invalid_reason": r.invalid_reason, "message": r.message,
                       "median_us": st.median if st else None, "spread": st.spread if st else None,
                       "min_us": st.minimum if st else None, "n": st.n if st else 0,
                       "plan_us": pst.median if pst else None, "compile_s": r.compile_s,
                       "max_rel_error": r.max_rel_error,
                       "method": getattr(r.samples, "method", None)}
                if st and ceilings:
                    row["pct_floor"] = pct_of_floor(st.median, w, ceilings.get("copy_gbps"),
                                                    ceilings.get("matmul_tflops"))
                if st:
                    row["gbps"], row["tflops"] = achieved(st.median, w)
                rows.append(row)
    finally:
        if store:
            store.close()
    return rows


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
    from mla_tune.families import Candidate, check_candidate
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.problem.workload import RAGGED_KINDS
    from mla_tune.store.results import is_results_db
    from mla_tune.validate import check_kv_tokens, output_file

    if heads is not None and given(ctx, "model", "tp"):
        raise UserError(f"--heads replaces --model/--tp; drop {', '.join('--' + n for n in given(ctx, 'model', 'tp'))}")
    if no_store and given(ctx, "db"):
        raise UserError("--no-store and --db exclude each other")
    if ragged not in RAGGED_KINDS:
        raise UserError(f"--ragged must be one of {', '.join(RAGGED_KINDS)}, got {ragged!r}")
    if samples < rounds and given(ctx, "rounds"):
        raise UserError(f"--samples {samples} cannot be split over --rounds {rounds}")
    try:
        cands = list(dict.fromkeys(check_candidate(Candidate.parse(c)) for c in candidates))
    except ValueError as e:
        raise UserError(str(e)) from None
    from mla_tune.tune.sweep import parse_sizes     # the one size-list rule, sweep's syntax
    try:
        batches, contexts = parse_sizes(batch, "batch"), parse_sizes(context, "context")
    except ValueError as e:
        raise UserError(f"--batch/--context: {e}") from None
    check_kv_tokens(max(batches), max(contexts))
    if not no_store:
        output_file(db, "--db", own=is_results_db)
    import torch
    dev = device.value if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda but torch sees no CUDA device")
    if not dev.startswith("cuda") and given(ctx, "ceilings"):
        raise UserError("--ceilings/--no-ceilings apply to CUDA only")
    workloads = bench_workloads(model, heads, tp, batches, contexts, q_len, ragged)
    settings = MeasureSettings(device=dev, warmup=warmup, samples=samples, plan_samples=plan_samples,
                               check=check)
    ceil = None
    if dev.startswith("cuda"):
        from mla_tune.problem.roofline import measure_ceilings
        from mla_tune.measure.timing import default_pool_bytes
        settings.min_pool_bytes = default_pool_bytes(dev)
        if ceilings:
            ceil = {k: v for k, v in measure_ceilings(dev).items() if k in ("copy_gbps", "matmul_tflops")}
    rows = run_bench(cands, workloads, settings, rounds, None if no_store else db, ceil,
                     command="mla-tune bench " + " ".join(candidates))
    if format == BenchFormat.json:
        console.print_json(json.dumps({"ceilings": ceil, "trials": rows}, default=str))
        return
    from rich.table import Table
    title = f"mla-tune bench on {dev}" + (
        f" (copy {ceil['copy_gbps']:.0f} GB/s, matmul {ceil['matmul_tflops']:.0f} TFLOP/s)" if ceil else "")
    t = Table(title=title)
    for col in ("workload", "candidate", "median us", "spread", "% floor", "GB/s", "TFLOP/s",
                "plan us", "compile s", "rel err", "status"):
        t.add_column(col, justify="left" if col in ("workload", "candidate", "status") else "right")
    for r in rows:
        status = "ok" if r["status"] == "ok" else f"{r['invalid_reason']}: {(r['message'] or '').splitlines()[0][:60] if r['message'] else ''}"
        t.add_row(r["workload"], r["candidate"], _fmt(r["median_us"], ".1f"),
                  _fmt(r["spread"] * 100 if r["spread"] is not None else None, ".1f") + ("%" if r["spread"] is not None else ""),
                  _fmt(r.get("pct_floor"), ".0f"), _fmt(r.get("gbps"), ".0f"), _fmt(r.get("tflops"), ".0f"),
                  _fmt(r["plan_us"], ".0f"), _fmt(r["compile_s"], ".2f"), _fmt(r["max_rel_error"], ".1e"),
                  status)
    console.print(t)
    if not no_store:
        console.print(f"stored {len(rows)} trial(s) in {db}")
