"""`mla-tune report`, `mla-tune emit`, `mla-tune show`: thin glue over mla_tune.report,
mla_tune.plot and mla_tune.emit. Every read command speaks the same --format vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from mla_tune.cli.app import app, console, err_console, fail
from mla_tune.render import OutputFormat

FORMAT_HELP = "Output: table (rich), json, csv or markdown"


def _known():
    from mla_tune.emit import EmitError
    from mla_tune.problem import ProblemError
    from mla_tune.report import ReportError
    from mla_tune.store import StoreError
    from vllm_metax.tuned_config import TunedConfigError
    return (EmitError, ReportError, StoreError, TunedConfigError, ProblemError)


def _open_store(db: str):
    from mla_tune.store import ResultsStore
    return ResultsStore(db, create=False)      # reading never creates a DB


def _mix(path: Optional[Path]):
    if path is None:
        return None
    from mla_tune.problem import WorkloadMix
    return WorkloadMix.from_file(str(path))


def _print(out) -> None:
    if isinstance(out, str):
        typer.echo(out, nl=not out.endswith("\n"))
    else:
        for r in out:
            console.print(r)


@app.command("report")
def report(
    db: str = typer.Option("results.db", "--db", help="Results DB to read (any machine's)"),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help=FORMAT_HELP,
                                        case_sensitive=False),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write plots to this PNG",
                                        dir_okay=False),
    device: Optional[str] = typer.Option(None, "--device",
                                         help="Only this device ('NVIDIA H200' or NVIDIA_H200)"),
    model: Optional[str] = typer.Option(None, "--model", help="Only this model preset (e.g. deepseek-v3)"),
    run: Optional[List[int]] = typer.Option(None, "--run", help="Only these run ids (repeat the option)"),
    mix: Optional[Path] = typer.Option(None, "--mix", help="Workload mix CSV (batch,context,weight) "
                                                           "weighting the global choice; default uniform"),
):
    """Per workload the candidates side by side, the best per bucket, the global choice and why."""
    from mla_tune.report import ReportFilter, build_report, render_report
    try:
        with _open_store(db) as store:
            rep = build_report(store, ReportFilter(device, model, tuple(run or ())), _mix(mix))
        _print(render_report(rep, format))
        if plot is not None:
            from mla_tune.plot import plot_report
            path = plot_report(rep, plot)
            # stderr keeps stdout parseable for json/csv
            err_console.print(f"wrote {path}", highlight=False)
    except _known() as e:
        fail(str(e))


@app.command("emit")
def emit(
    db: str = typer.Option("results.db", "--db", help="Results DB to read"),
    out: Path = typer.Option(Path("configs"), "--out", help="Folder for device_name=<device>.json",
                             file_okay=False),
    device: Optional[str] = typer.Option(None, "--device", help="Device to emit for (default: the "
                                         "only one measured, else this machine's)"),
    all_devices: bool = typer.Option(False, "--all-devices", help="One file per measured device"),
    model: Optional[str] = typer.Option(None, "--model", help="Only this model preset"),
    run: Optional[List[int]] = typer.Option(None, "--run", help="Only these run ids (repeat the option)"),
    mix: Optional[Path] = typer.Option(None, "--mix", help="Workload mix CSV (batch,context,weight)"),
):
    """Write the tuned config(s) the vllm_metax plugin loads, from the measurements in the DB."""
    from mla_tune.emit import config_summary, emit_all, emit_config
    from vllm_metax.tuned_config import read_tuned_config
    if all_devices and device:
        fail("--device and --all-devices exclude each other")
    try:
        with _open_store(db) as store:
            w = _mix(mix)
            runs = tuple(run or ())
            paths = (emit_all(store, out, model=model, runs=runs, mix=w) if all_devices else
                     [emit_config(store, out, device=device, model=model, runs=runs, mix=w)])
        for p in paths:
            for line in config_summary(read_tuned_config(p)):
                console.print(line, highlight=False, markup=False)
    except _known() as e:
        fail(str(e))


def _lookup(text: Optional[str]):
    if text is None:
        return None
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (2, 3) or min(vals) < 1:
        fail(f"--lookup takes BATCH,CONTEXT[,Q_LEN] as positive integers, got {text!r}")
    return (vals[0], vals[1], vals[2] if len(vals) == 3 else 1)


@app.command("show")
def show(
    file: Path = typer.Argument(..., help="A tuned config, e.g. configs/device_name=NVIDIA_H200.json"),
    device: Optional[str] = typer.Option(None, "--device", help="The device it must be for "
                                         "(default: this machine's accelerator, if it has one)"),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help=FORMAT_HELP,
                                        case_sensitive=False),
    lookup: Optional[str] = typer.Option(None, "--lookup", help="BATCH,CONTEXT[,Q_LEN]: which bucket "
                                         "serves this request (snapped on a log2 scale)"),
):
    """Validate a tuned config as the plugin reads it, and print it."""
    from mla_tune.report import check_config_device, render_config
    from vllm_metax.tuned_config import read_tuned_config
    req = _lookup(lookup)
    try:
        cfg = read_tuned_config(file)
        check_config_device(cfg, file, device)
        _print(render_config(cfg, format, req))
    except _known() as e:
        fail(str(e))
