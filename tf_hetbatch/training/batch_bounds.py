"""The per-replica batch bounds of `DynamicBatching` (`min_sizes`, `max_sizes`): checks.

A bound is an int for every part or one int per part. The checks run in two stages: each
bound alone and the two together when the callback is constructed, then against the number
of parts and the global batch once `fit` knows them. Pure Python + numpy.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Union

import numpy as np

from tf_hetbatch.core._validate import format_value

__all__ = ["Bounds", "check_bounds", "check_bounds_order", "check_bounds_admit",
           "plain_bounds", "bounds_arg"]

Bounds = Union[int, Sequence[int], None]


def check_bounds(name: str, value: Bounds, allow_none: bool) -> Bounds:
    """Checks one bound alone: an int (>= 0 for `min_sizes`, >= 1 for `max_sizes`) or a
    non-empty list of such ints; None only if `allow_none`. Returns an int or a tuple."""
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"`{name}` must be an integer >= 0 or one integer per replica. "
                         f"Received: {name}=None")
    minimum = 1 if name == "max_sizes" else 0
    items = [value] if np.ndim(value) == 0 else (list(value) if np.ndim(value) == 1 else None)
    ok = items is not None and len(items) > 0 and all(
        not isinstance(v, (bool, np.bool_)) and isinstance(v, numbers.Integral) and v >= minimum
        for v in items)
    if not ok:
        raise ValueError(f"`{name}` must be an integer >= {minimum} or a list of such integers, "
                         f"one per replica. Received: {name}={format_value(value)}")
    return int(value) if np.ndim(value) == 0 else tuple(int(v) for v in items)


def check_bounds_order(min_sizes: Bounds, max_sizes: Bounds) -> None:
    """At construction: no replica's minimum above its maximum (each already valid alone)."""
    if max_sizes is None:
        return
    if isinstance(min_sizes, tuple) and isinstance(max_sizes, tuple) \
            and len(min_sizes) != len(max_sizes):
        raise ValueError(
            "`min_sizes` and `max_sizes` must have the same length, one entry per replica. "
            f"Received: min_sizes={list(min_sizes)} ({len(min_sizes)} entries), "
            f"max_sizes={list(max_sizes)} ({len(max_sizes)} entries). Fix: give both one "
            "entry per replica, or one int for every replica.")
    lo, hi = np.broadcast_arrays(np.asarray(min_sizes), np.asarray(max_sizes))
    bad = np.flatnonzero(lo > hi)
    if bad.size:
        where = "" if lo.ndim == 0 else f" (replica {int(bad[0])}: {int(lo.flat[bad[0]])} > " \
            f"{int(hi.flat[bad[0]])})"
        raise ValueError(
            f"`min_sizes` must not exceed `max_sizes`{where}. Received: min_sizes="
            f"{format_value(plain_bounds(min_sizes))}, max_sizes="
            f"{format_value(plain_bounds(max_sizes))}. Fix: lower min_sizes or raise "
            "max_sizes (max_sizes=None: no cap).")


def check_bounds_admit(min_sizes: Bounds, max_sizes: Bounds, num: int,
                       total: Optional[int]) -> None:
    """When the replica count `num` (and the global batch `total`, None if unknown yet) is
    known: the bounds have one entry per replica and some split of `total` satisfies them."""
    for name, value in (("min_sizes", min_sizes), ("max_sizes", max_sizes)):
        if value is not None and np.ndim(value) == 1 and len(value) != num:
            raise ValueError(
                f"`{name}` must have one entry per replica ({num}). Received: {name}="
                f"{format_value(plain_bounds(value))} ({len(value)} entries). Fix: give "
                f"{num} entries, or one int for every replica.")
    if total is None:
        return
    lo = np.zeros(num, np.int64) if min_sizes is None else np.broadcast_to(
        np.asarray(min_sizes, np.int64), (num,))
    hi = np.full(num, total, np.int64) if max_sizes is None else np.minimum(
        np.broadcast_to(np.asarray(max_sizes, np.int64), (num,)), total)
    if int(lo.sum()) > total:
        raise ValueError(
            f"`min_sizes` must sum to at most the global batch size {total} over the {num} "
            f"replicas. Received: min_sizes={format_value(plain_bounds(min_sizes))} (sum "
            f"{int(lo.sum())}). Fix: lower min_sizes, or batch the data by at least "
            f"{int(lo.sum())}.")
    if int(hi.sum()) < total:
        raise ValueError(
            f"`max_sizes` must sum to at least the global batch size {total} over the {num} "
            f"replicas. Received: max_sizes={format_value(plain_bounds(max_sizes))} (sum "
            f"{int(hi.sum())}). Fix: raise max_sizes (None: no cap), or batch the data by at "
            f"most {int(hi.sum())}.")


def bounds_arg(value: Bounds) -> Union[int, List[int], None]:
    """A bound as a controller's constructor takes it (a list for per-part bounds)."""
    return list(value) if isinstance(value, tuple) else value


def plain_bounds(value: Bounds) -> Union[int, List[int], None]:
    """A bound as plain JSON-serialisable values."""
    if value is None or np.ndim(value) == 0:
        return None if value is None else int(value)
    return [int(v) for v in value]
