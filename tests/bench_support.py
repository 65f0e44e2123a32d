"""Load a script of bench/ (or bench/experiments/, bench/tools/) as a module, for the tests of its CPU parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
# the living benchmarks, the finished experiments, the lent-machine tools
BENCH_DIRS = (BENCH_DIR, BENCH_DIR / "experiments", BENCH_DIR / "tools")


def bench_path(name: str) -> Path:
    """Where bench/<name>.py lives: bench/, bench/experiments/ or bench/tools/."""
    found = [d / f"{name}.py" for d in BENCH_DIRS if (d / f"{name}.py").is_file()]
    if len(found) != 1:
        raise FileNotFoundError(f"{name}.py: {len(found)} copies under {BENCH_DIR}")
    return found[0]


def load_bench(name: str):
    """bench/[experiments/|tools/]<name>.py as a module, registered in sys.modules (dataclasses
    resolve string annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, bench_path(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
