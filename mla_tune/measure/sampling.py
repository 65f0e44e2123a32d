"""When a candidate has enough samples: a distribution-free confidence interval of the median.

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
