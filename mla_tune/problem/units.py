"""How a kernel time reads for people, in one place: every view, progress line and reason string
(the sweep's, the report's, `show`'s, the `why` a tuned config carries) formats microseconds here,
so one time reads the same wherever it is printed (never `1.979e+04` beside `8727`)."""

from __future__ import annotations

import math


def us(value) -> str:
    """Microseconds without the unit: one decimal below 100 (`16.6`), whole from there (`146`,
    `19790`: a tenth of a percent, far under the run-to-run noise); '-' for none. No thousands
    separator: the same digits a CSV or `-f json` carries."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.1f}" if abs(value) < 99.95 else f"{value:.0f}"


def us_text(value) -> str:
    """Microseconds with the unit: `8727 us`."""
    return f"{us(value)} us"
