"""The controllers' statistics: Student-t quantiles, the shared change detector, and the
sums of windows everything is estimated from (`WindowSums`).

Pure Python + numpy, no scipy.

The controllers estimate noise from a handful of windows, so a bound of `q` standard errors
must use Student's t with the estimate's degrees of freedom, not the normal quantile: with
3 degrees of freedom the 99.97% quantile is 14, not 3.4. Exact for small degrees of
freedom (the closed-form CDF of Abramowitz & Stegun 26.7.3/26.7.4, inverted by bisection),
the Cornish-Fisher expansion of A&S 26.7.5 beyond (its error there is below 1e-3 relative
for the probabilities used here; `tests/test_controllers.py` checks both against tables).
Fractional degrees of freedom (from forgotten sums) are rounded down: a wider bound.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ROUNDING", "WindowSums", "t_quantile", "alarm_quantile", "detect"]

# Below sqrt(machine epsilon) of its scale, a deviation from a prediction, a spread of sizes
# or a predicted saving is rounding error of the sums it came from.
ROUNDING = math.sqrt(np.finfo(np.float64).eps)


class WindowSums(NamedTuple):
    """Windows of one measured value: their count, sum and sum of squares.

    Scalars (the log step times of a split) or arrays of the same shape (a replica's compute
    times, e.g. per replica and arm).
    """

    count: Any
    sum: Any
    sum_sq: Any

    @property
    def mean(self) -> Any:
        return self.sum / self.count

    @property
    def squared_deviations(self) -> Any:
        """Of the windows from their mean."""
        return self.sum_sq - self.sum * self.sum / self.count

    def add(self, value: float) -> "WindowSums":
        """These windows and one more (scalars)."""
        return WindowSums(self.count + 1, self.sum + value, self.sum_sq + value * value)


# Above this many degrees of freedom the A&S 26.7.5 expansion is used instead of the exact
# CDF (whose series has dof / 2 terms).
_EXACT_MAX_DOF = 30
# Bisection on the angle theta = atan(t / sqrt(dof)) in [0, pi/2): 2**-60 of the range is
# below double precision.
_BISECTION_STEPS = 60


def t_quantile(p: float, dof: float) -> float:
    """The p-quantile of Student's t with `dof` degrees of freedom, for 0.5 <= p < 1.

    Returns `inf` when dof < 1 (no noise estimate yet: no finite bound).
    """
    if not 0.5 <= p < 1.0:
        raise ValueError(f"`p` must be in [0.5, 1). Received: p={p!r}")
    if not dof >= 1:  # also NaN
        return math.inf
    return _quantile(float(p), int(min(math.floor(dof), 2 ** 31)))


@functools.lru_cache(maxsize=4096)
def _quantile(p: float, dof: int) -> float:
    if dof > _EXACT_MAX_DOF:
        return _cornish_fisher(p, dof)
    target = 2.0 * p - 1.0  # P(|T| <= t)
    lo, hi = 0.0, math.pi / 2
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if _two_sided_cdf(mid, dof) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(dof) * math.tan(0.5 * (lo + hi))


def _two_sided_cdf(theta: float, dof: int) -> float:
    """A(t | dof) = P(|T| <= t) at theta = atan(t / sqrt(dof)) (A&S 26.7.3, 26.7.4)."""
    s, c = math.sin(theta), math.cos(theta)
    c2 = c * c
    if dof % 2:  # odd
        if dof == 1:
            return 2.0 * theta / math.pi
        term, total = c, c
        for k in range(3, dof - 1, 2):  # cos + 2/3 cos^3 + (2*4)/(3*5) cos^5 + ...
            term *= c2 * (k - 1) / k
            total += term
        return 2.0 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0
    for k in range(2, dof - 1, 2):  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ...
        term *= c2 * (k - 1) / k
        total += term
    return s * total


def _cornish_fisher(p: float, dof: int) -> float:
    """A&S 26.7.5: t = z + g1/v + g2/v^2 + g3/v^3 + g4/v^4 (the expansion's own coefficients)."""
    z = NormalDist().inv_cdf(p)
    z2 = z * z
    g1 = z * (z2 + 1) / 4
    g2 = z * ((5 * z2 + 16) * z2 + 3) / 96
    g3 = z * (((3 * z2 + 19) * z2 + 17) * z2 - 15) / 384
    g4 = z * ((((79 * z2 + 776) * z2 + 1482) * z2 - 1920) * z2 - 945) / 92160
    v = float(dof)
    return z + g1 / v + g2 / v ** 2 + g3 / v ** 3 + g4 / v ** 4


def alarm_quantile(false_move_rate: float, streams: int, dof: float) -> float:
    """The detector's bound: on noise alone, two windows running beyond it on the same side
    (a change) happen with probability `false_move_rate` per window over `streams` streams."""
    return t_quantile(1.0 - math.sqrt(false_move_rate / (2.0 * streams)), dof)


def detect(value, low, high, sd, q, held_sign):
    """The change detector on standardised residuals (vectorised; scalars work too).

    `value` deviates from the bracket [low, high] of its prediction by z = distance / sd;
    |z| > q flags it. A flag on the same side as the previous window's (`held_sign`; 0:
    none) is a change; any other flag is an outlier, held back. Returns
    `(z, outlier, change)`.
    """
    value = np.asarray(value, np.float64)
    dev = value - np.minimum(np.maximum(value, low), high)
    z = dev / np.maximum(sd, ROUNDING * np.abs(value))
    flag = np.abs(z) > q
    change = flag & (np.sign(z) == held_sign) & (np.asarray(held_sign) != 0)
    return z, flag & ~change, change
