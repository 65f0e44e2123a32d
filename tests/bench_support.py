"""Load a script of bench/ as a module, for the tests of its CPU parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str):
    """bench/<name>.py as a module, registered in sys.modules (dataclasses resolve string
    annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
