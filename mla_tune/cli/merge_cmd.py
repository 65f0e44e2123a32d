"""`mla-tune merge`: copy other results DBs' measurements into one (thin glue over mla_tune.store.merge)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer
from rich.markup import escape

from mla_tune.cli.app import app, console

HELP = ("Copy the runs, workloads, trials and samples of other results DBs into --db.\n\n"
        "Idempotent: what --db already holds is skipped, so merging the same file twice adds "
        "nothing. Each run keeps its device and host; emit writes one config per device. The "
        "sources are opened read-only.")


@app.command("merge", help=HELP, short_help="Copy other results DBs into one, idempotently.", epilog="Exit codes: 0 merged; 2 bad input (a file that is not "
             "a results DB, the target itself); nothing is written then.")
def merge(
    sources: List[Path] = typer.Argument(..., help="Results DBs to copy from (never modified)"),
    db: Path = typer.Option(Path("results.db"), "--db", help="The results DB to merge into "
                            "(created if missing)"),
):
    from mla_tune.store.merge import merge_into
    counts = merge_into(db, sources)
    for c in counts:
        devices = f" (devices: {', '.join(map(str, c.devices))})" if c.devices else ""
        skipped = f"; {c.known_trials} trials already in {db}" if c.known_trials else ""
        claimed = (f"; {c.claimed_elsewhere} answered there by another worker"
                   if c.claimed_elsewhere else "")
        console.print(f"{escape(str(c.source))}: {c.runs} runs{escape(devices)}, {c.workloads} "
                      f"workloads, {c.trials} trials, {c.samples} samples added{escape(skipped)}"
                      f"{escape(claimed)}", highlight=False)
