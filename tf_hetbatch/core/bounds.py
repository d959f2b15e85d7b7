"""Per-replica batch bounds (`min_sizes`, `max_sizes`): the one type and the one rule.

A bound is an int for every replica or one int per replica, each >= 0; `max_sizes` may be
None (no cap: the global batch), and so may each of its entries (no cap for that replica, as a
micro-batch limit of None means no bound). A maximum of 0 keeps a replica out of the split (it
gets empty batches, which the strategies run; the replica's `min_sizes` must then be 0 too).
The checks run in stages: each bound alone and the two together when a controller or
`DynamicBatching` is constructed (`check_bound`, `check_bounds_order`), then against the
number of replicas and the global batch once they are known (`resolve_bounds`). Every error
names the value and the fix. Pure Python + numpy.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from tf_hetbatch.core._validate import format_value

__all__ = ["Bounds", "check_bound", "check_bounds_order", "resolve_bounds", "plain_bounds"]

Bounds = Union[int, Sequence[int], None]


def check_bound(name: str, value: Bounds, allow_none: bool) -> Union[int, Tuple[int, ...], None]:
    """Checks one bound alone: an integer >= 0 or a non-empty list of such integers.

    Args:
        name: "min_sizes" or "max_sizes", as the user spells it.
        value: the bound received.
        allow_none: whether None (no bound) is allowed, as the whole bound or as an entry.

    Returns:
        An int, a tuple of ints (and Nones, where allowed), or None.

    Raises:
        ValueError: anything else, e.g. "`min_sizes` must be an integer >= 0 or a list of
            such integers, one per replica. Received: min_sizes=-1. Fix: ...".
    """
    if value is None and allow_none:
        return None
    items = None if value is None else [value] if np.ndim(value) == 0 else (
        list(value) if np.ndim(value) == 1 else None)
    if not items or not all((v is None and allow_none) or (
            isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) and v >= 0)
            for v in items):
        none = " (or None: no cap)" if allow_none else ""
        raise ValueError(f"`{name}` must be an integer >= 0 or a list of such integers, one per "
                         f"replica{none}. Received: {name}={format_value(value)}. Fix: pass e.g. "
                         f"{name}={1 if name == 'min_sizes' else 64}.")
    return int(value) if np.ndim(value) == 0 else tuple(
        None if v is None else int(v) for v in items)


def check_bounds_order(min_sizes: Bounds, max_sizes: Bounds) -> None:
    """Checks that no replica's minimum exceeds its maximum (each bound already checked alone).

    Raises:
        ValueError: lists of different lengths, or a minimum above its maximum.
    """
    if max_sizes is None or min_sizes is None:
        return
    if np.ndim(min_sizes) == 1 and np.ndim(max_sizes) == 1 and len(min_sizes) != len(max_sizes):
        raise ValueError(
            "`min_sizes` and `max_sizes` must have the same length, one entry per replica. "
            f"Received: min_sizes={list(min_sizes)} ({len(min_sizes)} entries), "
            f"max_sizes={list(max_sizes)} ({len(max_sizes)} entries). Fix: give both one "
            "entry per replica, or one int for every replica.")
    lo, hi = np.broadcast_arrays(np.asarray(min_sizes), _caps(max_sizes, np.iinfo(np.int64).max))
    bad = np.flatnonzero(lo > hi)
    if bad.size:
        where = "" if lo.ndim == 0 else f" (replica {int(bad[0])}: {int(lo.flat[bad[0]])} > " \
            f"{int(hi.flat[bad[0]])})"
        raise ValueError(
            f"`min_sizes` must not exceed `max_sizes`{where}. Received: min_sizes="
            f"{format_value(plain_bounds(min_sizes))}, max_sizes="
            f"{format_value(plain_bounds(max_sizes))}. Fix: lower min_sizes or raise "
            "max_sizes (max_sizes=None: no cap).")


def resolve_bounds(total: Optional[int], num: int, min_sizes: Bounds = None,
                   max_sizes: Bounds = None) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """Checks the bounds against `num` replicas and the global batch `total`; returns them.

    Args:
        total: the global batch the bounds must admit, or None when not known yet (then only
            the number of entries is checked).
        num: the number of replicas.
        min_sizes: None (0), an int for every replica, or a sequence of `num` ints.
        max_sizes: None (`total`), an int for every replica, or a sequence of `num` ints.

    Returns:
        `(lo, hi)`, int64 arrays of length `num` with `lo <= hi`, `sum(lo) <= total <=
        sum(hi)` and `hi` capped at `total`; None when `total` is None.

    Raises:
        ValueError: a bound that is not an integer >= 0 (or a list of them), has not one
            entry per replica, exceeds its maximum, or bounds no split of `total` satisfies.
    """
    for name, value in (("min_sizes", min_sizes), ("max_sizes", max_sizes)):
        if value is not None:
            check_bound(name, value, allow_none=name == "max_sizes")
            if np.ndim(value) == 1 and len(value) != num:
                raise ValueError(
                    f"`{name}` must have one entry per replica ({num}). Received: {name}="
                    f"{format_value(plain_bounds(value))} ({len(value)} entries). Fix: give "
                    f"{num} entries, or one int for every replica.")
    if total is None:
        return None
    lo = np.zeros(num, np.int64) if min_sizes is None else np.broadcast_to(
        np.asarray(min_sizes, np.int64), (num,)).copy()
    hi = np.minimum(np.broadcast_to(_caps(max_sizes, total), (num,)), total)
    check_bounds_order(min_sizes, max_sizes)  # (a minimum above `total`: the sum's error)
    if int(lo.sum()) > total:
        raise ValueError(
            f"`min_sizes` must sum to at most the global batch size {total} over the {num} "
            f"replicas. Received: min_sizes={format_value(plain_bounds(min_sizes))} (sum "
            f"{int(lo.sum())}). Fix: lower min_sizes, or use a global batch size of at least "
            f"{int(lo.sum())}.")
    if int(hi.sum()) < total:
        raise ValueError(
            f"`max_sizes` must sum to at least the global batch size {total} over the {num} "
            f"replicas. Received: max_sizes={format_value(plain_bounds(max_sizes))} (sum "
            f"{int(hi.sum())}). Fix: raise max_sizes (None: no cap), or use a global batch size "
            f"of at most {int(hi.sum())}.")
    return lo, hi


def plain_bounds(value: Bounds) -> Union[int, List[Optional[int]], None]:
    """A bound as plain JSON-serialisable values (an int, a list of ints and Nones, or None)."""
    if value is None or np.ndim(value) == 0:
        return None if value is None else int(value)
    return [None if v is None else int(v) for v in value]


def _caps(max_sizes: Bounds, none: int) -> np.ndarray:
    """`max_sizes` as int64, `none` for no cap (the whole bound or an entry)."""
    if max_sizes is None:
        return np.asarray(none, np.int64)
    if np.ndim(max_sizes) == 0:
        return np.asarray(max_sizes, np.int64)
    return np.asarray([none if v is None else v for v in max_sizes], np.int64)
