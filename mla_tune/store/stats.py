"""Statistics of raw samples, computed on read (the store keeps every sample, never a summary)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Stats:
    """Order statistics of one metric's samples."""

    n: int
    median: float
    mean: float
    stdev: float
    q1: float
    q3: float
    minimum: float

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0


def stats_of(values: list[float]) -> Stats | None:
    """Stats of `values` (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return Stats(len(v), statistics.median(v), statistics.fmean(v),
                 statistics.stdev(v) if len(v) > 1 else 0.0, q[0], q[2], v[0])

