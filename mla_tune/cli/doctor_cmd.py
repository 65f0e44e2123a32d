"""`mla-tune doctor`: thin glue over mla_tune.views.doctor."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mla_tune.cli.app import app, print_view
from mla_tune.views.render import OutputFormat
from mla_tune.validate import INT, PathOption

FORMAT_HELP = "Output: table (rich), json, csv or markdown"


@app.command("doctor", short_help="What the vLLM plugin sees here and which config it loads.")
def doctor(
    model: Optional[str] = typer.Option(None, "--model", help="Model preset to look up in the tuned "
                                        "config (e.g. deepseek-v3)"),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size the model is served at",
                           **INT["tp"].typer),
    probe: bool = typer.Option(False, "--probe", help="Plan and run each FlashInfer backend once on "
                               "this GPU (the first run of each compiles, ~20 s)"),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help=FORMAT_HELP,
                                        case_sensitive=False),
    traffic: Optional[Path] = PathOption(None, "--traffic", help="A server's recorded traffic "
                                         "(VLLM_METAX_TRAFFIC=FILE): warn when many of its steps "
                                         "fall outside the tuned buckets or far from them"),
):
    """Which device the plugin sees, whether it would activate, which backends are usable, and
    which tuned config it would load and why (or why none)."""
    from mla_tune.validate import check_name
    from mla_tune.views.doctor import diagnose
    if model is not None:
        check_name("--model", model)
    print_view(diagnose(model, tp, probe, traffic).render(format))
