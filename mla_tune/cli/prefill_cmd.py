"""`mla-tune prefill-sweep`: parse the flags, call mla_tune.tune.prefill, print one line per trial."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from mla_tune.cli.app import UserError, app, console, given
from mla_tune.store.traffic import DEFAULT_SHARE
from mla_tune.validate import FLOAT, INT, PathOption

HELP = ("Measure the MLA prefill backend (FlashInfer ragged prefill fa2/fa3 and, on Hopper, vLLM's "
        "FA3 varlen prefill vllm_fa3, through the plugin's own ops) on prefill buckets and store "
        "every trial in --db; `mla-tune emit` then writes the tuned config's prefill section.\n\n"
        "A bucket is a plan the plugin looks up: the new tokens of a step (causal; --new-tokens, "
        "each split over each of --new-requests equal requests) or one context chunk (non-causal; "
        "--chunk-queries x --chunk-kv KV tokens, one request), at the model's heads per rank for "
        "each --tp. A backend replaces the device default in a bucket only when it is faster by "
        "Mann-Whitney p < 0.002 and >= 1.05x. Rerun to resume: measured candidates are skipped.")


def _ints(text: str, flag: str) -> list[int]:
    from mla_tune.tune.sweep.buckets import parse_sizes     # the one size-list syntax ('256,1K', '1K-64K')
    try:
        return parse_sizes(text, "context")
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None


def _traffic_buckets(ctx, traffic: Path, share: float, model: str, tp) -> list:
    """--traffic: the prefill workloads of the recorded plans (traffic_plan.prefill_plan)."""
    from mla_tune.tune.traffic_plan import prefill_plan, prefill_workloads
    clash = given(ctx, "new_tokens", "new_requests", "chunk_queries", "chunk_kv")
    if clash:
        raise UserError(f"--traffic decides the prefill buckets; drop "
                        f"{', '.join('--' + n.replace('_', '-') for n in clash)}")
    FLOAT["share"].check("--traffic-share", share)
    plan = prefill_plan(traffic, share, model, tp)
    console.print(escape(plan.note), highlight=False, soft_wrap=True)
    return prefill_workloads(plan, model)


@app.command("prefill-sweep", help=HELP, short_help="Measure the MLA prefill backend per prefill bucket.", epilog="Exit codes: 0 measured (or nothing left to "
             "measure); 2 bad input or no GPU prefill kernel here; nothing is written then.")
def prefill_sweep(
    ctx: typer.Context,
    model: str = typer.Option("deepseek-v3", help="Model preset (mla_tune/problem/models.json)"),
    tp: Optional[List[int]] = typer.Option(None, "--tp", help="Tensor-parallel sizes (repeat; "
                                           "default 1 and 8)", **INT["tp"].typer),
    new_tokens: str = typer.Option("256,1024,2048,8192", "--new-tokens",
                                   help="Query tokens of the new-token plans"),
    new_requests: str = typer.Option("1,4", "--new-requests", help="Requests each is split over"),
    chunk_queries: str = typer.Option("256,2048", "--chunk-queries",
                                      help="Query tokens of the context-chunk plans"),
    chunk_kv: str = typer.Option("1K,4K,16K,64K", "--chunk-kv",
                                 help="KV tokens of the context-chunk plans"),
    samples: int = typer.Option(20, help="Kernel samples per candidate", **INT["samples"].typer),
    rounds: int = typer.Option(5, help="Interleaving rounds (samples are split over them)",
                               **INT["rounds"].typer),
    warmup: int = typer.Option(3, help="Warm-up runs after compile", **INT["warmup"].typer),
    remeasure: bool = typer.Option(False, help="Measure again what --db holds already"),
    db: Path = PathOption(Path("results.db"), help="Results DB to store the trials in"),
    traffic: Optional[Path] = PathOption(None, "--traffic", help="A server's recorded traffic "
                                         "(VLLM_METAX_TRAFFIC=FILE on the server): the buckets are "
                                         "the log2 cells holding --traffic-share of its prefill "
                                         "plans, at the TP size whose heads per rank it recorded "
                                         "(instead of --new-tokens ... --chunk-kv)"),
    traffic_share: float = typer.Option(DEFAULT_SHARE, "--traffic-share", help="The share of the "
                                        "recorded prefill plans the buckets cover",
                                        **FLOAT["share"].typer),
):
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.problem.defaults import KERNEL_METRIC
    from mla_tune.problem.units import us_text
    from mla_tune.store.sqlite_file import is_results_db
    from mla_tune.tune.prefill import PrefillSweepConfig, plan_prefill_buckets, run_prefill_sweep
    from mla_tune.validate import output_file
    import torch

    if traffic is not None:
        buckets = _traffic_buckets(ctx, traffic, traffic_share, model, tp)
    else:
        if given(ctx, "traffic_share"):
            raise UserError("--traffic-share applies only with --traffic FILE")
        buckets = plan_prefill_buckets(model, tuple(tp) if tp else (1, 8),
                                       _ints(new_tokens, "--new-tokens"),
                                       _ints(new_requests, "--new-requests"),
                                       _ints(chunk_queries, "--chunk-queries"),
                                       _ints(chunk_kv, "--chunk-kv"))
    output_file(db, "--db", own=is_results_db)
    if samples < rounds:
        raise UserError(f"--samples {samples} cannot be split over --rounds {rounds}")
    if not torch.cuda.is_available():
        raise UserError("prefill-sweep measures MLA prefill kernels (FlashInfer's, vLLM's FA3): torch sees no CUDA "
                        "device here")
    settings = MeasureSettings(device="cuda", warmup=warmup, samples=samples)
    config = PrefillSweepConfig(buckets, db, "cuda", settings, rounds, remeasure,
                                command="mla-tune prefill-sweep")

    def progress(w, results):
        for r in results:
            xs = sorted((r.samples or {}).get(KERNEL_METRIC) or [])
            what = us_text(xs[len(xs) // 2]) if xs else f"{r.invalid_reason}: {(r.message or '')[:80]}"
            console.print(f"{escape(w.label())}  {escape(r.candidate.key)}  {escape(what)}",
                          highlight=False)

    out = run_prefill_sweep(config, progress)
    console.print(f"{out.measured} prefill trial(s) measured ({out.invalid} invalid), "
                  f"{out.cached} already in {escape(str(db))}, {out.seconds:.0f} s; "
                  f"`mla-tune emit --db {escape(str(db))}` writes the prefill section", highlight=False)
