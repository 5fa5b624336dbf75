"""Small statistics for benchmark reports: spread over seeds, t-intervals, binomial sampling error.

Example::

    >>> round(t_interval([0.80, 0.82, 0.84])["half_width"], 4)   # mean 0.82, s = 0.02, t(2) = 4.303
    0.0497
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# Two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30 (beyond: the normal 1.96 is within 4%).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (>= 1)."""
    if df < 1:
        raise ValueError(f"Invalid df={df}: must be >= 1")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample std (0 for one value), min, max and n of the finite ``values``; ``diverged``
    counts the non-finite ones."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": math.inf, "std": math.nan, "min": math.inf, "max": math.inf, "n": 0, "diverged": len(values)}
    return {
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
        "n": len(finite),
        "diverged": len(values) - len(finite),
    }


def t_interval(values: Sequence[float]) -> dict[str, Any]:
    """95% confidence interval of the mean over seeds: ``mean ± t_{0.975, n-1} * s / sqrt(n)``.

    With one value the half width is NaN (no spread to estimate).
    """
    s = spread(values)
    n = s["n"]
    half = t975(n - 1) * s["std"] / math.sqrt(n) if n > 1 else math.nan
    return {**s, "half_width": half, "low": s["mean"] - half, "high": s["mean"] + half}


def binomial_half_width(accuracy: float, n: int) -> float:
    """95% half width of an accuracy measured on ``n`` test examples (normal approximation):
    the sampling noise of the test set alone, ``1.96 * sqrt(p (1 - p) / n)``."""
    if n <= 0:
        raise ValueError(f"Invalid n={n}: must be > 0")
    return 1.96 * math.sqrt(max(0.0, accuracy * (1 - accuracy)) / n)
