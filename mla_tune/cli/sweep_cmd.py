"""`mla-tune sweep`: measure the candidates of every bucket on this machine (or replay stored
measurements), store each trial, choose winners, emit the tuned config. Thin glue over
mla_tune.tune.sweep; the display is a SweepObserver drawing a rich progress bar and tables."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from mla_tune.cli.app import (EXIT_FAILURE, ProfileName, app, console, err_console, fail, given,
                              print_view, profile_option)
from mla_tune.cli.progress import LineProgress
from mla_tune.measure.worker import Isolation
from mla_tune.problem.defaults import SWEEP_PAGE_SIZES
from mla_tune.store.traffic import DEFAULT_SHARE
from mla_tune.problem.units import us_text
from mla_tune.problem.workload import DTYPES
from mla_tune.tune.verdict import MIN_RATIO
from mla_tune.tune import search
from mla_tune.tune.search import SearchMode as Mode
from mla_tune.tune.sweep.config import CPU_FAMILIES, GPU_FAMILIES, HEARTBEAT_S, SweepError
from mla_tune.validate import FLOAT, INT, InputError, PathOption
from mla_tune.views.render import to_rich
from mla_tune.views.sweep_view import plan_tables, summary_tables
from vllm_metax.core.profile import METAX, PROFILES

EPILOG = ("Exit codes: 0 done; 1 nothing could be measured (no kernel family runs here, or no "
          "valid trial); 2 bad input (flags, files, DB); 130 interrupted (finished trials are "
          "stored: rerun the same command to resume).")


class RichObserver:
    """Progress bar (ETA, current candidate, best so far) on a terminal, a progress line every
    few seconds on stderr otherwise; a line per bucket; summary tables."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.progress = None
        self.lines = None       # LineProgress where the console is no terminal (a pipe, a CI log)
        self.task = None
        self.best = {}

    # -------------------------------------------------------------- events
    def on_start(self, plan) -> None:
        self.plan = plan
        self.done = 0
        if plan.note:
            style = "bold yellow" if plan.kind == "cpu-reference" else "cyan"
            console.print(f"[{style}]{escape(plan.note)}[/]")
        for fam, why in plan.skipped.items():
            console.print(f"[yellow]skipped {escape(fam)}:[/] {escape(why)}")
        where = f"replay of {plan.db}" if plan.replay else f"device {plan.device}, DB {plan.db}"
        console.print(f"sweep on {escape(where)}; families: {', '.join(plan.families) or '-'}")
        console.print(escape(plan.estimate_note()))
        if plan.journal:
            console.print(f"optuna study: {escape(str(plan.journal))} "
                          f"(view with `optuna-dashboard {escape(str(plan.journal))}`)")
        elif getattr(plan, "storage", ""):
            console.print(f"optuna storage: {escape(plan.storage)} (shared with every worker on it)")
        if not self.quiet and not console.is_terminal:
            self.lines = LineProgress(err_console, "sweep", plan.planned_trials, "trials")
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            TextColumn("{task.fields[current]}"), TextColumn("{task.fields[best]}"),
            console=console, transient=True, disable=self.quiet or self.lines is not None)
        self.progress.start()
        self.task = self.progress.add_task("sweep", total=max(plan.planned_trials, 1), current="",
                                           best="")

    def on_bucket(self, planned) -> None:
        # a space may shrink (refusals learnt in earlier buckets) and a TPE search may stop before
        # its budget: keep the total honest so the ETA is
        total = self.done + sum(p.budget for p in self.plan.buckets[planned.index:])
        self.progress.update(self.task, total=max(total, 1))
        if self.lines is not None:
            self.lines.update(self.done, note=planned.bucket.workload.label(), total=total)
        self.progress.update(self.task, description=escape(planned.bucket.workload.label()),
                             current=f"{planned.mode} {len(planned.space)} pts", best="")

    def on_measuring(self, planned, candidates) -> None:
        self.progress.update(self.task, current=escape(f"measuring {len(candidates)}: {candidates[0].key}"
                                                       + (" ..." if len(candidates) > 1 else "")))

    def on_prepared(self, planned, candidate, ok) -> None:
        mark = "" if ok else " (invalid)"
        self.progress.update(self.task, current=escape(f"{candidate.key}{mark}"))

    def on_trial(self, planned, ev, best) -> None:
        self.progress.advance(self.task)
        if self.lines is not None:
            self.lines.update(advance=1)
        if best is not None:
            self.progress.update(self.task, best=escape(f"best {best.candidate.key} {us_text(best.value)}"))

    def on_bucket_done(self, bo) -> None:
        so = bo.search
        self.done += len(so.evaluations)
        self.progress.update(self.task, completed=self.done)
        if self.lines is not None:
            self.lines.update(self.done)
        b = so.best
        extra = "" if so.stopped == "complete" else f" [yellow]({so.stopped})[/]"
        inval = f", {bo.invalid} invalid" if bo.invalid else ""
        best = f"best {escape(b.candidate.key)} {us_text(b.value)}" if b else "[red]no valid candidate[/]"
        self.progress.console.print(
            f"[green]done[/] {escape(bo.bucket.label)}: {so.mode} {len(so.evaluations)}/{so.space_size}"
            f" ({so.measured} measured{inval}) {best}{extra}", highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.lines is not None:
            self.lines.close()
            self.lines = None

    def on_workers(self, workers) -> None:
        console.print(f"{len(workers)} worker processes: " + ", ".join(
            f"GPU {escape(g)} (pid {pid})" for g, pid in workers), highlight=False)

    def on_done(self, outcome) -> None:
        self.close()
        print_summary(outcome)


def print_summary(outcome) -> None:
    """The end-of-sweep tables: per model entry, per bucket and family the chosen candidate, its
    time and its gain over the family default (n.s. = no significant difference)."""
    ch = outcome.choice
    if ch is None:
        console.print("[red]no trials to choose from[/]")
        return
    print_view(to_rich(summary_tables(ch)))
    for n in ch.notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    o = outcome
    if o.plan.replay:
        console.print(f"replayed {o.measured} stored trials in {o.seconds:.1f} s; nothing measured")
    else:
        console.print(f"{o.measured} trials measured, {o.cached} answered from {escape(str(o.plan.db))}"
                      f" (already measured), {o.faults} crashed or timed out"
                      f" ({o.restarts} worker restarts), {o.seconds:.1f} s")
        if o.time_line():
            console.print(escape(o.time_line()), highlight=False)
    for w in getattr(o, "workers", None) or ():
        state = "done" if w.returncode == 0 else f"[yellow]exited {w.returncode}[/]" + (
            f" ({escape(w.error)})" if w.error else "")
        console.print(f"worker GPU {escape(w.gpu)} (pid {w.pid}): {state}, {w.measured} measured",
                      highlight=False)
    if o.stopped_early:
        console.print(f"[yellow]time budget reached: {o.stopped_early} buckets were not searched "
                      "to the end; rerun the same command to continue[/]")
    if o.emitted:
        console.print(f"tuned config: [bold]{escape(str(o.emitted))}[/]")
    elif o.emit_note:
        console.print(f"[yellow]{escape(o.emit_note)}[/]")


HELP = (
    "Measure each bucket's candidates, store every trial, choose winners, emit the config.\n\n"
    "Buckets are batch x context (log2 steps) x q_len at each --tp; each is searched with optuna "
    "(grid when small, TPE when large) in a crash-safe worker process. A challenger displaces a "
    "family default only with Mann-Whitney p < 0.002 and --min-ratio.\n\n"
    "Without CUDA it measures the CPU torch reference into results-cpu.db and emits no tuned "
    "config (the CPU is not a serving device) unless --emit.\n\n"
    "Rerun the same command to resume: nothing already in the DB is measured again (unless "
    "--remeasure). --replay runs the search over a DB's stored measurements instead (no GPU).")

# the options, in --help order (module constants keep the command itself a few lines of glue)
DB = PathOption(None, "--db", help="Results DB (SQLite) to store every trial in (default: "
                "results.db; without CUDA results-cpu.db)")
MODEL = typer.Option(None, "--model", "-m", help="Model preset (heads, MLA dims; default deepseek-v3)")
TP = typer.Option(None, "--tp", help="Tensor-parallel size; repeat for several (default: GPU 1 and "
                  "8, CPU 8)", **INT["tp"].typer)
BATCHES = typer.Option(None, "--batches", help="Batch sizes: '1-128' (powers of two) or '1,4,16' "
                       "(default: GPU 1-128, CPU 1,4)")
CONTEXTS = typer.Option(None, "--contexts", help="Context lengths: '1K-32K' (powers of two) or "
                        "'1024,4096' (default: GPU 1K-32K, CPU 256,1024)")
Q_LEN = typer.Option(None, "--q-len", help="Query tokens per request; repeat (q_len > 1 = "
                     "speculative decode, causal; default 1)", **INT["q_len"].typer)
LENGTHS = typer.Option(None, "--lengths", "--ragged", help="Per-request context lengths in a "
                       "bucket: uniform, zipf, uniform-random, lognormal, or a CSV of request "
                       "lengths (column context_len, length, prompt_len ...) scaled to each "
                       "bucket's context (default: uniform, plus the GPU's zipf buckets)")
Q_DTYPE = typer.Option("bfloat16", "--q-dtype", help=f"Query dtype: {' or '.join(DTYPES)}")
KV_DTYPE = typer.Option("bfloat16", "--kv-dtype", help=f"KV-cache dtype: {' or '.join(DTYPES)}")
PAGE_SIZE = typer.Option(None, "--page-size", help="KV page sizes (powers of two, 1-256); repeat "
                         f"(default {', '.join(map(str, SWEEP_PAGE_SIZES))})")
FAMILY = typer.Option(None, "--family", help=f"Kernel families; repeat (default: GPU "
                      f"{', '.join(GPU_FAMILIES)}, --profile metax: "
                      f"{', '.join(PROFILES[METAX].sweep_families)}; CPU {', '.join(CPU_FAMILIES)}; "
                      "opt-in: flashmla)")
PROFILE = profile_option("limit every family to what that target runs (metax: FlashInfer fa2 "
                         "through the flat API, no TMA or PDL split pipes, the vendor's Triton "
                         "launch beside vLLM's, FlashMLA at page 64); recorded with the results "
                         "and in the config")
MODE = typer.Option(Mode.auto, "--mode", help="Search: auto (grid when the space is small), grid or tpe")
GRID_MAX = typer.Option(search.GRID_MAX, "--grid-max", help="Largest space auto searches exhaustively",
                        **INT["grid_max"].typer)
TRIALS = typer.Option(None, "--trials", help="Most candidates evaluated per bucket (default: grid "
                      "all, TPE a quarter of the space)", **INT["trials"].typer)
PATIENCE = typer.Option(search.PATIENCE, "--patience", help="TPE: stop a bucket after this many new trials "
                        "without improvement (0: never)", **INT["patience"].typer)
TIME_BUDGET = typer.Option(None, "--time-budget", help="Wall-time budget: 600, 9m, 1h (default: "
                           "GPU 9m, CPU none; 0: none)")
TIMEOUT = typer.Option(None, "--timeout", help="Seconds one candidate may take (JIT included) "
                       "before it counts as hung", **FLOAT["timeout"].typer)
SAMPLES = typer.Option(None, "--samples", help="Kernel samples per candidate", **INT["samples"].typer)
WARMUP = typer.Option(None, "--warmup", help="Warm-up runs per candidate", **INT["warmup"].typer)
ISOLATION = typer.Option(Isolation.auto, "--isolation", help="Process: measure in a worker process "
                         "replaced after a crash or hang; inline: in this process; auto: process "
                         "unless only the CPU reference runs")
REMEASURE = typer.Option(False, "--remeasure", help="Measure again what the DB already holds")
REPLAY = PathOption(None, "--replay", help="Run the search over this DB's stored measurements "
                    "instead of measuring (no GPU needed)")
DEVICE_NAME = typer.Option(None, "--device-name", help="Replay: the device whose trials to use "
                           "when the DB holds several")
MIX = PathOption(None, "--mix", help="CSV of batch,context,weight rows: the workload mix the page "
                 "size is chosen for (default uniform); every row must be a swept bucket")
TRAFFIC = PathOption(None, "--traffic", help="A server's recorded traffic (VLLM_METAX_TRAFFIC=FILE "
                     "on the server): the buckets are the log2 cells holding --traffic-share of its "
                     "decode steps (instead of --batches/--contexts/--q-len; the TP size is the "
                     "one whose heads per rank it recorded), weighted by its step counts for the "
                     "page size and backend order; with --replay, the weights only")
TRAFFIC_SHARE = typer.Option(DEFAULT_SHARE, "--traffic-share", help="The share of the recorded "
                             "steps the buckets cover", **FLOAT["share"].typer)
MIN_RATIO_OPT = typer.Option(MIN_RATIO, "--min-ratio", help="Smallest speed-up that displaces a "
                             "default", **FLOAT["min_ratio"].typer)
SEED = typer.Option(0, "--seed", help="Sampler seed", **INT["seed"].typer)
NAME = typer.Option("sweep", "--name", help="Label stored with each trial and the optuna study")
CONFIGS_DIR = PathOption(Path("configs"), "--configs-dir", help="Where the tuned config goes")
EMIT = typer.Option(None, "--emit/--no-emit", help="Write the tuned config (default: on a GPU yes; "
                    "without CUDA no: the CPU reference is not a serving device)")
JOURNAL = PathOption(None, "--journal", help="Optuna journal file (default: next to the DB, "
                     "<db>.optuna.log)")
GPUS = typer.Option(None, "--gpus", help="One worker process per GPU, e.g. 0,1,2,3 or all (each "
                    "with CUDA_VISIBLE_DEVICES set to its GPU); they share the optuna storage, "
                    "each candidate measured once")
STORAGE = typer.Option(None, "--storage", help="Optuna storage shared by workers: "
                       "postgresql://user:pw@host/db for several hosts, or a journal file "
                       "(default: <db>.optuna.log)")
HEARTBEAT = typer.Option(HEARTBEAT_S, "--heartbeat", help="RDB storage: seconds between heartbeats of a "
                         "claimed trial; a trial silent for 2x this is retried elsewhere")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar or progress lines")
DRY_RUN = typer.Option(False, "--dry-run", help="Check the flags and print every bucket's search "
                       "plan; measure and write nothing")


@app.command("sweep", help=HELP, epilog=EPILOG,
             short_help="Measure candidates per bucket, choose winners, emit the config.")
def sweep(
    ctx: typer.Context, db: Optional[Path] = DB, model: Optional[str] = MODEL,
    tp: Optional[List[int]] = TP, batches: Optional[str] = BATCHES,
    contexts: Optional[str] = CONTEXTS, q_len: Optional[List[int]] = Q_LEN,
    lengths: Optional[str] = LENGTHS, q_dtype: str = Q_DTYPE, kv_dtype: str = KV_DTYPE,
    page_size: Optional[List[int]] = PAGE_SIZE, family: Optional[List[str]] = FAMILY,
    profile: Optional[ProfileName] = PROFILE, mode: Mode = MODE, grid_max: int = GRID_MAX, trials: Optional[int] = TRIALS,
    patience: int = PATIENCE, time_budget: Optional[str] = TIME_BUDGET,
    timeout: Optional[float] = TIMEOUT, samples: Optional[int] = SAMPLES,
    warmup: Optional[int] = WARMUP, isolation: Isolation = ISOLATION, remeasure: bool = REMEASURE,
    replay: Optional[Path] = REPLAY, device_name: Optional[str] = DEVICE_NAME,
    mix: Optional[Path] = MIX, traffic: Optional[Path] = TRAFFIC,
    traffic_share: float = TRAFFIC_SHARE, min_ratio: float = MIN_RATIO_OPT, seed: int = SEED,
    name: str = NAME, configs_dir: Path = CONFIGS_DIR, emit: Optional[bool] = EMIT,
    journal: Optional[Path] = JOURNAL, gpus: Optional[str] = GPUS, storage: Optional[str] = STORAGE,
    heartbeat: int = HEARTBEAT, quiet: bool = QUIET, dry_run: bool = DRY_RUN,
):
    """Measure each bucket's candidates, store every trial, choose winners, emit the config."""
    # the sweep's modules import torch: here, so that `mla-tune --help` does not wait for it
    from mla_tune.tune.sweep.replay import replay_sweep
    from mla_tune.tune.sweep.request import SweepRequest
    from mla_tune.tune.sweep.run import run_sweep
    # the flags as the library takes them: an enum flag (--mode, --profile) as its value
    flags = {k: getattr(v, "value", v) for k, v in ctx.params.items() if k != "quiet"}
    request = SweepRequest(**flags, given=frozenset(given(ctx, *flags)),
                           command=" ".join(shlex.quote(a) for a in ["mla-tune"] + sys.argv[1:]))
    try:
        observer = RichObserver(quiet)
        if replay is not None:
            outcome = replay_sweep(replay, request.replay_config(), observer,
                                   device_name=device_name, where=request.replay_filter())
        else:
            config = request.config()
            if request.traffic_plan is not None:
                console.print(escape(request.traffic_plan.note), highlight=False, soft_wrap=True)
            if dry_run:
                return _dry_run(config)
            try:
                outcome = run_sweep(config, observer)
            finally:
                observer.close()      # Ctrl-C or an error: leave the terminal clean
    except ValueError as e:       # the sweep's parsers raise plain ValueErrors for bad input
        if isinstance(e, SweepError):     # SweepInputError: the app maps it (exit 2)
            raise
        raise InputError(str(e)) from None
    if not outcome.valid_trials and not any(r["status"] == "ok" for r in outcome.rows):
        fail("no candidate produced a valid measurement", EXIT_FAILURE)


def _dry_run(config) -> None:
    """--dry-run: every input checked as a live sweep checks it, then its plan; nothing runs."""
    from mla_tune.tune.sweep.check import check_sweep_config
    from mla_tune.tune.sweep.plan import plan_sweep
    config = check_sweep_config(config)
    plan, _ = plan_sweep(config)
    if plan.note:
        console.print(escape(plan.note), highlight=False)
    print_view(to_rich(plan_tables(plan, plan.estimate_note())))
