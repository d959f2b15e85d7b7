"""Integer split arithmetic for per-replica batch sizes (pure Python + numpy).

The global batch `B` is split into per-replica sizes `b_1..b_K` with `sum(b_k) == B`
exactly. Every function here is deterministic: the same arguments give the same split on
every worker, ties are always broken by replica index (lower index first).

No TensorFlow import here (tested by `tests/test_pure_core_imports.py`).
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch.core._validate import check_int, format_value
from tf_hetbatch.core.bounds import Bounds, resolve_bounds

logger = logging.getLogger(__name__)

__all__ = [
    "split_evenly",
    "split_proportionally",
    "validate_sizes",
    "water_fill",
    "equal_finish_level",
    "equal_finish_fill",
    "round_preserving_sum",
]


def split_evenly(total: int, parts: int) -> Tuple[int, ...]:
    """Splits `total` into `parts` integers as evenly as possible.

    Args:
        total: int >= 0, the quantity to split (e.g. the global batch size).
        parts: int >= 1, the number of parts (e.g. the number of replicas).

    Returns:
        A tuple of `parts` python ints summing to `total`; the first `total % parts` parts
        get one more than the others.

    Raises:
        ValueError: if `total` or `parts` is not a non-negative (resp. positive) integer.

    Example:
        >>> split_evenly(10, 3)
        (4, 3, 3)
    """
    total = check_int("total", total, 0)
    parts = check_int("parts", parts, 1)
    base, extra = divmod(total, parts)
    return tuple(base + 1 if k < extra else base for k in range(parts))


def _whole_numbers(name: str, value, num: int) -> np.ndarray:
    """`value` (a 1-D sequence of `num` whole numbers >= 0) as an int64 array."""
    items = list(value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        # Fast path for numeric arrays (no booleans possible); errors go the slow way.
        arr = value
        as_float = arr.astype(np.float64)
        if np.all(np.isfinite(as_float)) and np.all(as_float == np.floor(as_float)) and \
                np.all(as_float >= 0):
            return as_float.astype(np.int64) if arr.dtype.kind == "f" else arr.astype(np.int64)
    out = np.empty(num, dtype=np.int64)
    for k, item in enumerate(items):
        if isinstance(item, (bool, np.bool_)):
            raise ValueError(f"`{name}` must contain integers, not booleans. "
                             f"Received: {name}={format_value(value)}")
        try:
            as_float = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"`{name}` must contain integers. "
                             f"Received: {name}={format_value(value)}") from None
        if not np.isfinite(as_float) or as_float != np.floor(as_float):
            raise ValueError(f"`{name}` must contain whole numbers (e.g. 3 or 3.0), found "
                             f"{item!r} at index {k}. Received: {name}={format_value(value)}")
        if as_float < 0:
            raise ValueError(f"`{name}` must be >= 0, found {item!r} at index {k}. "
                             f"Received: {name}={format_value(value)}")
        out[k] = int(as_float)
    return out


def water_fill(total: float, offsets: np.ndarray, slopes: np.ndarray, lo: np.ndarray,
               hi: np.ndarray) -> np.ndarray:
    """Solves `sum_k clip(offsets_k + slopes_k * lam, lo_k, hi_k) == total` for the level lam.

    The function of lam is non-decreasing and piecewise linear; it is evaluated exactly at
    all breakpoints (O(K log K), no iteration). Arguments are assumed valid:
    `slopes >= 0`, `lo <= hi`, `sum(lo) <= total <= sum(hi)`.

    Args:
        total: target sum.
        offsets, slopes, lo, hi: float arrays of length K.

    Returns:
        The real-valued allocation `x` (float64 array), `lo <= x <= hi`, `sum(x) ~= total`.
        Entries with zero slope sit at `clip(offset, lo, hi)`; if the entries with positive
        slope cannot absorb `total`, the rest goes to zero-slope entries evenly.
    """
    return _water_level(total, offsets, slopes, lo, hi)[0]


def equal_finish_level(total: float, alpha: ArrayLike, rates: ArrayLike,
                       lo: Optional[ArrayLike] = None,
                       hi: Optional[ArrayLike] = None) -> Tuple[float, np.ndarray]:
    """The real-valued equal-finish split: the level T every replica's share finishes at.

    Replica k, given x_k samples, finishes at `alpha_k + x_k / rates_k`. The split is
    `x_k = clip((T - alpha_k) * rates_k, lo_k, hi_k)` with `sum(x) == total` (water-filling,
    `water_fill`): every replica strictly inside its bounds finishes at T; one at `lo` would
    finish later than T even with less (its alpha is above T), one at `hi` sooner. A replica
    of rate 0 gets `lo`. Arguments are assumed valid: `rates >= 0`, `lo <= hi`,
    `sum(lo) <= total <= sum(hi)`.

    Args:
        total: samples to split, e.g. the global batch size.
        alpha: float array [K], each replica's time for no samples (seconds).
        rates: float array [K], each replica's samples per second beyond alpha (1 / beta_k).
        lo, hi: float arrays [K] of bounds; default 0 and none.

    Returns:
        `(T, x)`: the level (seconds; NaN when no rate is positive) and the float64 split.

    Example:
        >>> level, x = equal_finish_level(12.0, [0.0, 1.0], [2.0, 2.0])
        >>> float(level), x.tolist()
        (3.5, [7.0, 5.0])
    """
    rates = np.asarray(rates, np.float64)
    alpha = np.asarray(alpha, np.float64)
    lo = np.zeros_like(rates) if lo is None else lo
    # No share reaches total + 1: above 0, some share is strictly inside its bounds, so the
    # level is unique (a share capped at `total` would leave a range of levels).
    hi = np.full_like(rates, float(total) + 1.0) if hi is None else hi
    x, level = _water_level(total, -alpha * rates, rates, lo, hi)
    return level, x


def _water_level(total, offsets, slopes, lo, hi) -> Tuple[np.ndarray, float]:
    """`water_fill`'s allocation and its level lam (NaN when no positive slope sets one)."""
    offsets = np.asarray(offsets, np.float64)
    slopes = np.asarray(slopes, np.float64)
    lo = np.asarray(lo, np.float64)
    hi = np.asarray(hi, np.float64)
    active = slopes > 0
    fixed = np.minimum(np.maximum(offsets, lo), hi)  # np.clip, without its overhead
    x = np.where(active, 0.0, fixed)
    if not active.any() or hi[active].sum() + fixed[~active].sum() < total:
        # Positive-slope entries (if any) saturate; spread what is left over the others.
        x = np.where(active, hi, fixed)
        rest = ~active
        if rest.any():
            x[rest] = water_fill(total - x[active].sum(), np.zeros(rest.sum()),
                                 np.ones(rest.sum()), lo[rest], hi[rest])
        return x, math.nan
    a, w, l, h = offsets[active], slopes[active], lo[active], hi[active]
    # Entry k leaves its lower bound at lam = (l - a) / w and reaches its upper at (h - a) / w.
    lam = _fill_level(np.concatenate([(l - a) / w, (h - a) / w]), w, l.sum(),
                      total - fixed[~active].sum())
    x[active] = np.minimum(np.maximum(a + w * lam, l), h)
    return x, float(lam)


def equal_finish_fill(total: float, alpha: ArrayLike, beta: ArrayLike, lo: ArrayLike,
                      hi: ArrayLike) -> np.ndarray:
    """The real-valued equal-finish split: x_k = clip((T - alpha_k) / beta_k, lo_k, hi_k) with
    sum x_k = total, for replicas that finish `x_k` samples at `alpha_k + beta_k * x_k`.

    `water_fill` in the finish time's own units (the level T is a time; all beta > 0), as the
    controllers solve it every window: O(K log K), no iteration. Arguments are assumed valid:
    `beta > 0`, `lo <= hi`, `sum(lo) <= total <= sum(hi)`.

    Returns:
        The float64 split.
    """
    alpha, beta = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    rate = 1.0 / beta
    # Replica k leaves its lower bound at T = alpha_k + beta_k lo_k, reaches its upper at ...hi_k.
    level = _fill_level(np.concatenate([alpha + beta * lo, alpha + beta * hi]), rate, lo.sum(),
                        total)
    return np.minimum(np.maximum((level - alpha) * rate, lo), hi)


def _fill_level(points: np.ndarray, rates: np.ndarray, floor: float, need: float) -> float:
    """Water-filling's level: where sum_k clip(...) reaches `need`, exactly.

    `points` are the 2K breakpoints of the entries (first the K where each leaves its lower
    bound, then the K where each reaches its upper), `rates` how fast each grows in between,
    `floor` the sum at the lowest breakpoint. The sum is piecewise linear between the sorted
    breakpoints; the level is interpolated in its segment (an unstable sort: the order within
    ties of breakpoints does not change the level).
    """
    order = np.argsort(points, kind="quicksort")
    points = points[order]
    slope = np.cumsum(np.concatenate([rates, -rates])[order])
    value = floor + np.concatenate([[0.0], np.cumsum(slope[:-1] * np.diff(points))])
    j = int(np.searchsorted(value, need, side="left"))
    if j == 0:
        return points[0]
    if j >= points.size:
        return points[-1]
    return points[j - 1] + ((need - value[j - 1]) / slope[j - 1] if slope[j - 1] > 0 else 0.0)


def round_preserving_sum(x: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray,
                         priority=None) -> np.ndarray:
    """Rounds a real allocation to integers with sum exactly `total`, within `[lo, hi]`.

    Floors `x`, then gives one more to the `total - sum(floor)` entries with the highest
    priority (default: the largest fractional part, i.e. largest-remainder rounding), ties
    broken by lower index. `priority` may be an array or a function of the floored
    int64 array returning one. Arguments are assumed valid (integral, feasible bounds).

    Returns:
        An int64 array.
    """
    x = np.minimum(np.maximum(np.asarray(x, np.float64), lo), hi)
    near = np.round(x)
    x = np.where(np.abs(x - near) < 1e-9, near, x)
    base = np.floor(x).astype(np.int64)
    base = np.minimum(np.maximum(base, lo), hi)
    missing = int(total - base.sum())
    if callable(priority):
        priority = priority(base)
    if missing > 0:
        key = (x - base) if priority is None else np.asarray(priority, np.float64)
        key = np.where(base < hi, key, -np.inf)
        order = np.argsort(-key, kind="stable")
        base[order[:missing]] += 1
    elif missing < 0:  # only reachable through float noise; take from the smallest remainders
        key = (x - base) if priority is None else -np.asarray(priority, np.float64)
        key = np.where(base > lo, key, np.inf)
        order = np.argsort(key, kind="stable")
        base[order[:-missing]] -= 1
    return base


def split_proportionally(total: int, capacities: ArrayLike, min_sizes: Bounds = None,
                         max_sizes: Bounds = None) -> Tuple[int, ...]:
    """Splits `total` into integers proportional to `capacities`, within bounds.

    The real-valued split `x_k = clip(lam * c_k, min_k, max_k)` with `sum(x) == total`
    (water-filling: bounded replicas are clamped, the rest share what is left in
    proportion) is rounded with the largest-remainder method, ties broken by replica
    index. Without bounds every size is within 1 of `total * c_k / sum(c)`.

    Args:
        total: int >= 0, e.g. the global batch size.
        capacities: 1-D array-like of K finite numbers >= 0, not all zero (e.g. measured
            throughputs or peak FLOP/s). Replicas with zero capacity get their minimum.
        min_sizes: None (0), an int for all replicas, or a sequence of K ints.
        max_sizes: None (no cap), an int for all replicas, or a sequence of K ints.

    Returns:
        A tuple of K python ints, summing to `total`, each within its bounds.

    Raises:
        ValueError: on negative, NaN, infinite or all-zero capacities, a wrong number of
            bounds, or bounds that no split can satisfy.

    Example:
        >>> split_proportionally(64, [1.0, 3.0])
        (16, 48)
        >>> split_proportionally(64, [1.0, 3.0], max_sizes=40)
        (24, 40)
    """
    total = check_int("total", total, 0)
    try:
        caps = np.asarray(capacities, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"`capacities` must be a 1-D sequence of numbers. "
                         f"Received: capacities={format_value(capacities)}") from None
    if caps.ndim != 1 or caps.size == 0:
        raise ValueError(f"`capacities` must be a non-empty 1-D sequence of numbers, one per "
                         f"replica. Received: capacities={format_value(capacities)}")
    if not np.all(np.isfinite(caps)) or np.any(caps < 0):
        raise ValueError(f"`capacities` must be finite and >= 0 (e.g. throughputs in "
                         f"samples/s). Received: capacities={format_value(capacities)}")
    if not np.any(caps > 0):
        raise ValueError(f"`capacities` must have at least one positive entry; all-zero "
                         f"capacities give no proportion. "
                         f"Received: capacities={format_value(capacities)}")
    lo, hi = resolve_bounds(total, caps.size, min_sizes, max_sizes)
    x = water_fill(float(total), np.zeros_like(caps), caps / caps.max(), lo, hi)
    sizes = round_preserving_sum(x, total, lo, hi)
    return tuple(sizes.tolist())


def validate_sizes(sizes: ArrayLike, num_replicas: int,
                   global_batch: Optional[int] = None) -> Tuple[int, ...]:
    """Checks a per-replica batch-size allocation and returns it as python ints.

    Args:
        sizes: a sequence of `num_replicas` whole numbers >= 0 (ints, or floats such as 3.0;
            booleans and fractional values are rejected).
        num_replicas: the number of replicas in sync.
        global_batch: if given, `sizes` must sum to it.

    Returns:
        A tuple of python ints.

    Raises:
        ValueError: on a wrong length, negative, non-integral or boolean entries, or a sum
            different from `global_batch`.

    Example:
        >>> validate_sizes([16, 48.0], 2, global_batch=64)
        (16, 48)
    """
    num_replicas = check_int("num_replicas", num_replicas, 1)
    if isinstance(sizes, (str, bytes)) or np.ndim(sizes) != 1:
        raise ValueError(f"`batch_sizes` must be a 1-D sequence of {num_replicas} integers, one "
                         f"per replica. Received: batch_sizes={format_value(sizes)}")
    if len(sizes) != num_replicas:
        raise ValueError(f"`batch_sizes` must have one entry per replica ({num_replicas}), got "
                         f"{len(sizes)}. Received: batch_sizes={format_value(sizes)}")
    try:
        out = _whole_numbers("batch_sizes", sizes, num_replicas)
    except ValueError as err:
        raise ValueError(str(err)) from None
    if global_batch is not None:
        global_batch = check_int("global_batch", global_batch, 0)
        if int(out.sum()) != global_batch:
            raise ValueError(
                f"`batch_sizes` must sum to the global batch size {global_batch}. Received: "
                f"batch_sizes={format_value(sizes)} (sum {int(out.sum())}). Adjust the sizes, e.g. "
                f"with split_proportionally({global_batch}, batch_sizes).")
    return tuple(out.tolist())
