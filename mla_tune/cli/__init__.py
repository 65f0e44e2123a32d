"""`mla-tune`: thin Typer commands over the library. Each command lives in its own module and
registers itself on the shared app."""

from mla_tune.cli.app import app, main  # noqa: F401

# importing a command module registers its commands
from mla_tune.cli import (  # noqa: E402,F401
    sweep_cmd, report_cmd, bench_cmd, doctor_cmd, merge_cmd, prefill_cmd, prebuild_cmd,
)
