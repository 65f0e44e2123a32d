"""The significance rule (asv's): in one bucket, at one page size, does a family's fastest valid
candidate beat the family's untuned default beyond noise? Only if a one-sided Mann-Whitney U test
on the raw kernel samples gives p < `p_threshold` (0.002) AND the default's median is at least
`min_ratio` (1.05) times the challenger's; a default that is invalid or was never measured gives
way to the fastest valid candidate. mla_tune.tune.choose applies it to every bucket of a model
entry; the prefill choice applies it as it is.

    decide(measured, default_key, family, page_size) -> Verdict
    compare(default_samples, challenger_samples)      -> (significant, p, ratio)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from vllm_metax.core.tuned_config import speedup

P_THRESHOLD = 0.002
MIN_RATIO = 1.05
NO_SIGNIFICANT_DIFFERENCE = "no significant difference"


@dataclass(frozen=True)
class Measured:
    """One candidate's latest trial in one bucket, reduced to what a verdict needs."""

    key: str
    family: str
    backend: str
    page_size: int
    params: dict
    status: str                     # ok | invalid
    invalid_reason: str | None
    median_us: float | None
    samples: tuple = ()
    trial_id: int | None = None
    is_default: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.median_us is not None

    @property
    def plan_params(self) -> dict:
        """Plan-time parameters without the page size: {"backend": ..., **knobs}."""
        return {"backend": self.backend, **self.params}


@dataclass(frozen=True)
class Verdict:
    """The decision for one bucket, family and page size.

    `chosen` is what a server should run (the default unless a challenger won), `best` the
    fastest valid candidate, `significant` True only when `chosen` is a challenger that passed
    both tests. `p_value` and `ratio` (default median / best median) are None when there was
    nothing to compare. `reason` is one line for people.
    """

    family: str
    page_size: int
    chosen: Measured | None
    default: Measured | None
    best: Measured | None
    significant: bool
    reason: str
    p_value: float | None = None
    ratio: float | None = None
    n_valid: int = 0
    n_invalid: int = 0

    @property
    def time_us(self) -> float | None:
        return self.chosen.median_us if self.chosen else None

    @property
    def default_time_us(self) -> float | None:
        return self.default.median_us if self.default and self.default.ok else None

    @property
    def gain(self) -> float | None:
        """default time / chosen time (1.0 when the default stayed)."""
        return speedup(self.default_time_us, self.time_us)



def min_p_value(n1: int, n2: int) -> float:
    """The smallest one-sided exact Mann-Whitney p two samples of these sizes can reach."""
    return 1.0 / math.comb(n1 + n2, n1) if n1 and n2 else 1.0


def compare(default_samples: Sequence[float], challenger_samples: Sequence[float],
            p_threshold: float = P_THRESHOLD, min_ratio: float = MIN_RATIO) -> tuple[bool, float, float]:
    """(significant, p, ratio): is the challenger faster than the default, beyond noise?

    p is a one-sided Mann-Whitney U test (the default's samples greater; exact up to 30 samples
    each, so its floor is `min_p_value`); ratio is
    median(default) / median(challenger). Significant only if p < p_threshold and
    ratio >= min_ratio.
    """
    from scipy.stats import mannwhitneyu    # lazy: scipy only where two samples are compared (not on --help)
    ratio = statistics.median(default_samples) / statistics.median(challenger_samples)
    if len(default_samples) < 2 or len(challenger_samples) < 2:
        return False, 1.0, ratio
    # the exact distribution for the sample counts a sweep takes (scipy's "auto" would switch to
    # the normal approximation above 8 samples, which overstates p several-fold at 10 vs 10)
    exact = max(len(default_samples), len(challenger_samples)) <= 30
    p = float(mannwhitneyu(default_samples, challenger_samples, alternative="greater",
                           method="exact" if exact else "auto").pvalue)
    return (p < p_threshold and ratio >= min_ratio), p, ratio


def decide(measured: Sequence[Measured], default_key: str | None, family: str, page_size: int,
           p_threshold: float = P_THRESHOLD, min_ratio: float = MIN_RATIO) -> Verdict:
    """The verdict for one bucket, family and page size from its candidates' latest trials."""
    ok = [m for m in measured if m.ok]
    n_invalid = len(measured) - len(ok)
    default = next((m for m in measured if m.key == default_key), None) if default_key else None
    best = min(ok, key=lambda m: (m.median_us, m.key)) if ok else None
    common = dict(family=family, page_size=page_size, default=default, best=best,
                  n_valid=len(ok), n_invalid=n_invalid)
    if best is None:
        return Verdict(chosen=None, significant=False, reason="no valid candidate", **common)
    if default is None:
        return Verdict(chosen=best, significant=False,
                       reason=f"no default measured; fastest valid: {best.key}", **common)
    if not default.ok:
        return Verdict(chosen=best, significant=False,
                       reason=f"default {default.key} invalid ({default.invalid_reason}); "
                              f"fastest valid: {best.key}", **common)
    if best.key == default.key:
        return Verdict(chosen=default, significant=False, reason="the default is the fastest", **common)
    significant, p, ratio = compare(default.samples, best.samples, p_threshold, min_ratio)
    if significant:
        return Verdict(chosen=best, significant=True, p_value=p, ratio=ratio,
                       reason=f"{ratio:.2f}x faster than the default (Mann-Whitney p={p:.1e})", **common)
    why = []
    if p >= p_threshold:
        floor = min_p_value(len(default.samples), len(best.samples))
        why.append(f"p={p:.2g} >= {p_threshold:g}" + (
            f"; {len(default.samples)}/{len(best.samples)} samples cannot reach it" if floor >= p_threshold else ""))
    if ratio < min_ratio:
        why.append(f"{ratio:.3f}x < {min_ratio:g}x")
    return Verdict(chosen=default, significant=False, p_value=p, ratio=ratio,
                   reason=f"{NO_SIGNIFICANT_DIFFERENCE}: {best.key} vs default ({', '.join(why)})",
                   **common)

