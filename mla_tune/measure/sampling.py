"""How a batch of candidates is sampled: in interleaved rounds (`sample_in_rounds`), each leaving
once it has enough samples: a distribution-free confidence interval of the median.

The sweep's verdicts (mla_tune.tune.choose) call a candidate faster than its family default only
when Mann-Whitney gives p < 0.002 and the medians differ by >= 1.05x. Sampling stops early for a
candidate once it has `min_samples` and the 95% interval of its median, from order statistics
(no distribution assumed), is at most `rel_width` of the median wide (default 2%, i.e. +-1%, a
fifth of the 5% gain a verdict needs); otherwise it goes on to the full count. The minimum is 10:
two sets of n samples each can reach p < 0.002 in Mann-Whitney's two-sided exact test only from
n = 7 on (at n = 6 the smallest possible p is 2/924 = 0.0022), and with 10 a complete separation
gives p = 1.1e-5, so a real 5% gap measured with +-1% medians is never lost to the early stop.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

MIN_SAMPLES = 10
REL_WIDTH = 0.02
LEVEL = 0.95


@lru_cache(maxsize=256)
def _ranks(n: int, level: float) -> tuple[int, int]:
    """0-based (lo, hi) order-statistic indices of the median's `level` interval for n samples."""
    alpha = 1.0 - level
    cdf, j = 0.0, 0
    # largest j with P(Bin(n, 1/2) < j) <= alpha / 2: [x_(j), x_(n-j+1)] (1-based) covers the median
    for k in range(n + 1):
        p = math.comb(n, k) / 2.0 ** n
        if cdf + p > alpha / 2:
            break
        cdf += p
        j = k + 1
    j = max(j, 1)
    return j - 1, n - j


def median_interval(xs, level: float = LEVEL) -> tuple[float, float]:
    """The distribution-free `level` confidence interval of the median of `xs` (n >= 1)."""
    s = sorted(xs)
    lo, hi = _ranks(len(s), level)
    return s[lo], s[hi]


def enough_samples(xs, min_samples: int = MIN_SAMPLES, rel_width: float = REL_WIDTH) -> bool:
    """Whether sampling may stop: at least `min_samples`, and the median's 95% interval at most
    `rel_width` of the median wide."""
    n = len(xs)
    if n < max(min_samples, 1):
        return False
    lo, hi = median_interval(xs)
    s = sorted(xs)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    return med > 0 and (hi - lo) <= rel_width * med


def sample_in_rounds(timers: dict, samples: int, rounds: int,
                     enough: Callable | None = None) -> tuple[dict, dict]:
    """(samples, errors) by key: up to `samples` from every timer (`.sample(n)` -> a list), ceil(samples
    / rounds) per round, the order rotated by one per round so drift spreads over all. A timer leaves
    the rounds when its sampling raised (the exception in `errors`), it has `samples`, or `enough`
    (its samples so far) says so."""
    per_round = max(1, math.ceil(samples / max(rounds, 1)))
    got = {k: [] for k in timers}
    errors: dict = {}
    live, r = list(timers), 0
    while live:
        j = r % len(live)
        for k in live[j:] + live[:j]:
            try:
                got[k].extend(timers[k].sample(min(per_round, samples - len(got[k]))))
            except Exception as exc:  # noqa: BLE001 - a failed sample is data: the caller records it
                errors[k] = exc
        r += 1
        live = [k for k in live if k not in errors and len(got[k]) < samples
                and not (enough is not None and enough(got[k]))]
    return got, errors
