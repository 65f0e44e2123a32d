"""The options and the --analyze reading that bench scripts measuring shape by shape share
(prefill_choice.py, triton_vs_flashinfer.py): size lists, a time budget, a smoke run, re-analysis."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ints(text: str) -> tuple:
    """'1,8,32' -> (1, 8, 32)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_shape_run_options(ap: argparse.ArgumentParser, *, budget_s: float, quick: str,
                          analyze: str) -> None:
    """--budget-s, --quick and --analyze, with each script's default budget and help."""
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help="start no new shape after this many seconds (results so far are kept)")
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--analyze", metavar="JSON", help=analyze)


def read_earlier_run(path: str) -> dict | None:
    """The JSON of an earlier run, or None after saying on stderr why it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read {path}: {e}", file=sys.stderr)
        return None
