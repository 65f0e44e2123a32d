"""`mla-tune prebuild`: thin glue over mla_tune.measure.served_prebuild and jit_prebuild."""

from __future__ import annotations

import time
from typing import Optional

import typer

from mla_tune.cli.app import EXIT_FAILURE, UserError, app, err_console
from mla_tune.validate import INT

HELP = ("Build the FlashInfer JIT modules a tuned config serves, ahead of the server: run once "
        "after install (and after each new config or FlashInfer upgrade), so vLLM's first start "
        "does not compile them (nvcc, ~20 s each) during warm-up and CUDA-graph capture.\n\n"
        "Builds into FlashInfer's own JIT cache, which the server reads: "
        "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default: the home folder); run it as "
        "the user, and with the environment, the server runs with. The modules are the MLA "
        "decode backends its buckets plan and the ragged-prefill backends its prefill buckets "
        "(and the device default) plan; vLLM's FA3 and FlashMLA ship compiled.\n\n"
        "On a machine without a GPU give --arch and --config; the server finds that build only "
        "where the paths are the same (same image: venv, CUDA_HOME, FLASHINFER_WORKSPACE_BASE).")


@app.command("prebuild", help=HELP, short_help="Build the FlashInfer modules a tuned config serves, "
             "once after install.", epilog="Exit codes: 0 every module built (or --dry-run); "
             "1 a module failed to build; 2 bad input (no config, no target, no nvcc).")
def prebuild(
    config: Optional[str] = typer.Option(None, "--config", help="Tuned config file (default: the "
                                         "one the plugin loads on this GPU, as `mla-tune doctor` "
                                         "finds it)"),
    model: Optional[str] = typer.Option(None, "--model", help="Only the entry this model preset "
                                        "runs with (e.g. deepseek-v3; default: every entry)"),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size the --model is served at",
                           **INT["tp"].typer),
    arch: Optional[str] = typer.Option(None, "--arch", help="Target GPU arch as FlashInfer's "
                                       "FLASHINFER_CUDA_ARCH_LIST spells it, e.g. 9.0a for "
                                       "H100/H200 (default: this GPU's)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Compiler processes at once "
                                       "(default: the CPU count)", **INT["jobs"].typer),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the modules and whether each is "
                                 "built; build nothing"),
):
    from mla_tune.measure import served_prebuild as sp
    from mla_tune.validate import check_name
    if model is not None:
        check_name("--model", model)
    try:
        target = sp.resolve_target(arch)
        sp.apply_target(target)                  # before anything imports FlashInfer
        cfg = sp.load_config(config)
        modules = sp.served_modules(sp.select_entries(cfg, model, tp), target)
        folder = sp.cache_folder()
        sp.check_names(modules)
        if not dry_run and modules:
            sp.find_nvcc()
    except sp.PrebuildError as e:
        raise UserError(str(e)) from None
    cap = ".".join(map(str, target.capability))
    typer.echo(f"target: sm {cap} ({target.source}); config: {cfg.path}")
    typer.echo(f"FlashInfer JIT cache: {folder}")
    if not modules:
        typer.echo("no FlashInfer JIT module to build: the config serves none on this target")
        return
    built = {m: m.built() for m in modules}
    if dry_run:
        for m in modules:
            typer.echo(f"{'built' if built[m] else 'missing':8} {m.describe()}: {m.name}")
        n = sum(built.values())
        typer.echo(f"{len(modules)} modules: {n} built, {len(modules) - n} to build")
        return
    from mla_tune.measure.jit_prebuild import build_modules

    def done(m, seconds, error):
        state = "failed" if error else ("checked" if built[m] else "built")
        typer.echo(f"{state:8} {seconds:7.1f} s  {m.describe()}: {m.name}")
        if error:
            err_console.print(f"  {error}", highlight=False, soft_wrap=True, markup=False)

    t0 = time.monotonic()
    results = build_modules(modules, jobs or sp.default_jobs(), done)
    failed = [m for m, _, err in results if err]
    new = [m for m, _, err in results if not err and not built[m]]
    typer.echo(f"{len(modules)} modules in {time.monotonic() - t0:.1f} s wall: {len(new)} built, "
               f"{len(modules) - len(new) - len(failed)} already built, {len(failed)} failed")
    if failed:
        raise typer.Exit(EXIT_FAILURE)
