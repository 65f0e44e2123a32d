"""`mla-tune report`, `mla-tune emit`, `mla-tune show`: thin glue over mla_tune.views.report,
mla_tune.views.plot and mla_tune.tune.emit. Every read command speaks the same --format vocabulary, opens the
results DB read-only, and checks every output path before it starts."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from mla_tune.cli.app import (ProfileName, app, console, err_console, fail, given, print_view,
                              profile_option, profile_value)
from mla_tune.views.render import OutputFormat
from mla_tune.validate import INT, PathArgument, PathOption

FORMAT_HELP = "Output: table (rich), json, csv or markdown"
DB_HELP = ("Results DB to read, opened read-only (default: results.db, or results-cpu.db on a "
           "machine without CUDA, where `mla-tune sweep` puts the CPU reference)")


def _db_path(db: Optional[Path]) -> Path:
    from mla_tune.views.report import db_to_read
    return db_to_read(db)


def _open_store(db: Path):
    from mla_tune.store.results import ResultsStore
    return ResultsStore(db, create=False)      # read-only: reading never creates or alters a DB


def _mix(path: Optional[Path]):
    if path is None:
        return None
    from mla_tune.problem.workload import WorkloadMix
    return WorkloadMix.from_file(str(path))


TRAFFIC_HELP = ("A server's recorded traffic (VLLM_METAX_TRAFFIC=FILE on the server): its decode "
                "step counts weigh the page size and backend order of the model entry it recorded, "
                "each step counted for the bucket the plugin's lookup snaps it to")


def _weights(mix: Optional[Path], traffic: Optional[Path]):
    """--mix or --traffic (not both) as the choice's weights, or None."""
    if mix is not None and traffic is not None:
        fail("--mix and --traffic exclude each other (both weigh the buckets)")
    if traffic is None:
        return _mix(mix)
    from mla_tune.store.traffic import load_traffic
    return load_traffic(traffic).select().mix()


def _filter(device, model, run):
    from mla_tune.store.selection import TrialFilter
    from mla_tune.validate import INT
    return TrialFilter(device, model, tuple(INT["run"].check("--run", r) for r in run or ()))


def _traffic_report(ctx, traffic: Path, config: Optional[Path], format, plot: Optional[Path]):
    """report --traffic: what the tuned config gives the recorded traffic (views.traffic_view)."""
    from mla_tune.store.traffic import load_traffic
    from mla_tune.views.traffic_view import (config_for_traffic, entry_for_traffic, plot_traffic,
                                             traffic_report)
    clash = given(ctx, "db", "full", "device", "model", "run", "mix")
    if clash:
        fail(f"--traffic reports on the tuned config, not the DB: drop "
             f"{', '.join('--' + n for n in clash)}")
    t = load_traffic(traffic)
    part = t.select()
    cfg = config_for_traffic(t.device_name, config)
    entry = entry_for_traffic(cfg, part)
    print_view(traffic_report(part, entry, str(cfg.path or config)).render(format))
    if plot is not None:
        err_console.print(f"wrote {plot_traffic(part, entry, plot)}", highlight=False)


@app.command("report", short_help="Summarise what was measured: fastest per bucket, verdict.")
def report(
    ctx: typer.Context,
    db: Optional[Path] = PathOption(None, "--db", help=DB_HELP),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help=FORMAT_HELP,
                                        case_sensitive=False),
    full: bool = typer.Option(False, "--full", help="Table and markdown: every candidate of every "
                              "workload, the runs and the per-bucket verdicts (default: the "
                              "one-screen summary; json and csv always carry everything)"),
    plot: Optional[Path] = PathOption(None, "--plot", help="Also write plots to this PNG (a new "
                                        "file or an earlier plot; never anything else)"),
    device: Optional[str] = typer.Option(None, "--device",
                                         help="Only this device ('NVIDIA H200' or NVIDIA_H200)"),
    model: Optional[str] = typer.Option(None, "--model", help="Only this model preset (e.g. deepseek-v3)"),
    run: Optional[List[int]] = typer.Option(None, "--run", help="Only these run ids (repeat the option)",
                                            **INT["run"].typer),
    mix: Optional[Path] = PathOption(None, "--mix", help="Workload mix CSV (batch,context,weight) "
                                       "weighting the global choice; default uniform"),
    traffic: Optional[Path] = PathOption(None, "--traffic", help="A server's recorded traffic "
                                         "(VLLM_METAX_TRAFFIC=FILE): instead of the DB report, the "
                                         "expected per-step attention time of the tuned config "
                                         "against untuned on it, and the share of its steps outside "
                                         "or far from the tuned buckets; --plot: its (batch, "
                                         "context) density with the tuned buckets"),
    config: Optional[Path] = PathOption(None, "--config", help="With --traffic: the tuned config "
                                        "to judge (default: the one the plugin loads for the "
                                        "traffic's device)"),
):
    """The best kernel per bucket and the global choice (page size, backend order) with its reason;
    --full for every candidate."""
    from mla_tune.views.report import build_report
    from mla_tune.views.report_format import render_report
    from mla_tune.validate import check_distinct_paths, is_png, output_file
    if plot is not None:
        check_distinct_paths(("--db", db), ("--plot", plot))
        output_file(plot, "--plot", own=is_png, suffix=".png")   # before anything runs
    if traffic is not None:
        return _traffic_report(ctx, traffic, config, format, plot)
    if config is not None:
        fail("--config applies only with --traffic FILE")
    flt = _filter(device, model, run)
    w = _mix(mix)
    with _open_store(_db_path(db)) as store:
        rep = build_report(store, flt, w)
    print_view(render_report(rep, format, full=full))
    if plot is not None:
        from mla_tune.views.plot import plot_report
        path = plot_report(rep, plot)
        # stderr keeps stdout parseable for json/csv
        err_console.print(f"wrote {path}", highlight=False)


@app.command("emit", short_help="Write the tuned config the vllm_metax plugin loads.")
def emit(
    ctx: typer.Context,
    db: Optional[Path] = PathOption(None, "--db", help=DB_HELP),
    configs_dir: Path = PathOption(Path("configs"), "--configs-dir", "--out", metavar="DIR",
                                   help="Folder for device_name=<device>.json"),
    device: Optional[str] = typer.Option(None, "--device", help="Device to emit for (default: the "
                                         "only one measured, else this machine's)"),
    all_devices: bool = typer.Option(False, "--all-devices", help="One file per measured device"),
    model: Optional[str] = typer.Option(None, "--model", help="Only this model preset"),
    run: Optional[List[int]] = typer.Option(None, "--run", help="Only these run ids (repeat the option)",
                                            **INT["run"].typer),
    mix: Optional[Path] = PathOption(None, "--mix", help="Workload mix CSV (batch,context,weight)"),
    traffic: Optional[Path] = PathOption(None, "--traffic", help=TRAFFIC_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check everything and say what would "
                                 "be written; write nothing"),
    profile: Optional[ProfileName] = profile_option(
        "only trials measured under it", "the one the device's trials were measured under"),
):
    """Write the tuned config(s) the vllm_metax plugin loads, from the measurements in the DB.
    A CPU-reference config goes into the packaged configs/ only with an explicit --configs-dir."""
    from mla_tune.tune.emit import config_summary, config_to_emit, configs_to_emit
    from mla_tune.validate import check_distinct_paths, output_folder
    from vllm_metax.core.tuned_config import read_tuned_config, write_tuned_config
    if all_devices and device is not None:
        fail("--device and --all-devices exclude each other")
    check_distinct_paths(("--db", db), ("--configs-dir", configs_dir))
    output_folder(configs_dir, "--configs-dir")
    flt = _filter(device, model, run)
    kw = dict(model=flt.model, runs=flt.runs, mix=_weights(mix, traffic), cpu_ok=bool(given(ctx, "configs_dir")),
              profile=profile_value(profile))
    with _open_store(_db_path(db)) as store:
        planned = (configs_to_emit(store, configs_dir, **kw) if all_devices else
                   [config_to_emit(store, configs_dir, device=flt.device, **kw)])
    for cfg, path in planned:
        lines = (config_summary(cfg, path, "would write") if dry_run else
                 config_summary(read_tuned_config(write_tuned_config(cfg, configs_dir))))
        for line in lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    if dry_run:
        console.print("dry run: nothing written", highlight=False)


@app.command("show", short_help="Validate and print a tuned config; --lookup: what is served.")
def show(
    file: Path = PathArgument(..., metavar="FILE",
                              help="A tuned config, e.g. configs/device_name=NVIDIA_H200.json"),
    device: Optional[str] = typer.Option(None, "--device", help="The device it must be for "
                                         "(default: this machine's accelerator, if it has one)"),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help=FORMAT_HELP,
                                        case_sensitive=False),
    lookup: Optional[str] = typer.Option(None, "--lookup", help="BATCH,CONTEXT[,Q_LEN], e.g. 32,6K: "
                                         "which bucket serves this request (snapped on a log2 "
                                         "scale)"),
):
    """Validate a tuned config as the plugin reads it, and print it."""
    from mla_tune.views.show import check_config_device, parse_lookup, render_config
    from vllm_metax.core.tuned_config import check_device_name, read_tuned_config
    req = parse_lookup(lookup) if lookup is not None else None
    if device is not None:
        check_device_name(device, "--device")
    cfg = read_tuned_config(file)
    check_config_device(cfg, file, device)
    print_view(render_config(cfg, format, req))
