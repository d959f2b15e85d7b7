"""Memory bounds of replicas: how many samples each computes at once (pure Python + numpy).

A replica's bound m_k (an int >= 1, or None: unbounded) caps the samples it computes at once,
not its share of the global batch: a share b_k > m_k is computed in ceil(b_k / m_k)
micro-batches within the same training step (`tf_hetbatch.distribute.micro_batches`), each
of at most m_k samples. No TensorFlow import here.

The controllers balance on measured time, not on the bound, and need no term of their own
for the micro-batches: a fixed cost c per micro-batch adds c * ceil(b / m) to a replica's
step, and ceil(b / m) = b / m + r with 0 <= r < 1, so it is the slope c / m per sample and
about c / 2 of intercept of the affine time model t = alpha + beta * b (`time_models`), fitted
from times that include it. The equal-finish split prices it in, up to the rounding of the
count (at most c on a replica's time).
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch.core._validate import format_value

__all__ = ["Limits", "check_limits", "micro_batch_counts", "limits_array", "lowered_limit",
           "resumed_limits"]

# One bound per replica: an int >= 1, or None for no bound.
Limits = Tuple[Optional[int], ...]


def check_limits(limits: Sequence[Optional[int]], num_replicas: int,
                 name: str = "limits") -> Limits:
    """`limits` checked: one int >= 1 or None per replica.

    Args:
        limits: a sequence of `num_replicas` entries, each an int >= 1 (samples a replica
            computes at once) or None (no bound).
        num_replicas: the number of replicas.
        name: the argument's name, for the error.

    Returns:
        A tuple of python ints and Nones.

    Raises:
        ValueError: not a sequence of `num_replicas` such entries (naming the value and
            the fix).
    """
    fix = (f"Fix: pass one entry per replica ({num_replicas}), each an int >= 1 (the samples "
           "it computes at once) or None (no bound), e.g. "
           f"{name}={[None] * min(num_replicas, 3) + ['...'] * (num_replicas > 3)}.")
    if isinstance(limits, (str, bytes)) or np.ndim(limits) != 1 or len(limits) != num_replicas:
        raise ValueError(f"`{name}` must have one entry per replica ({num_replicas}). "
                         f"Received: {name}={format_value(limits)}. {fix}")
    out = []
    for k, value in enumerate(limits):
        if value is None:
            out.append(None)
            continue
        whole = isinstance(value, numbers.Integral) or (
            isinstance(value, numbers.Real) and float(value).is_integer())
        if isinstance(value, (bool, np.bool_)) or not whole or value < 1:
            raise ValueError(f"`{name}` entries must be ints >= 1 or None, found {value!r} at "
                             f"index {k}. Received: {name}={format_value(limits)}. {fix}")
        out.append(int(value))
    return tuple(out)


def limits_array(limits: Sequence[Optional[int]]) -> np.ndarray:
    """int64 array of `limits` with 0 for no bound (the form the step reads)."""
    return np.array([0 if m is None else int(m) for m in limits], np.int64)


def micro_batch_counts(sizes: ArrayLike, limits: Optional[Sequence[Optional[int]]]) -> np.ndarray:
    """Micro-batches per replica: ceil(b_k / m_k), 1 for an unbounded or empty share.

    Args:
        sizes: per-replica samples (ints or floats >= 0).
        limits: per-replica bounds (ints >= 1 or None), or None for none at all.

    Returns:
        float64 array of the counts (floats: the controllers' regressors).

    Example:
        >>> micro_batch_counts([10, 96, 97, 0], [None, 48, 48, 48]).tolist()
        [1.0, 2.0, 3.0, 1.0]
    """
    sizes = np.asarray(sizes, np.float64)
    if limits is None:
        return np.ones_like(sizes)
    m = limits_array(limits).astype(np.float64)
    bounded = m > 0
    return np.where(bounded, np.maximum(np.ceil(sizes / np.where(bounded, m, 1.0)), 1.0), 1.0)


def lowered_limit(micro_batch_size: int) -> Optional[int]:
    """The bound after a micro-batch of `micro_batch_size` samples ran out of memory: half of
    it (so a replica re-runs a step at most log2(b) times), or None if it held 1 sample (no
    bound can help)."""
    size = int(micro_batch_size)
    return None if size <= 1 else size // 2


def resumed_limits(current: Optional[Limits], saved: Optional[Sequence[Optional[int]]]
                   ) -> Optional[Limits]:
    """The bounds to resume with: per replica the lower of the bounds set now and those
    saved with the checkpoint (lowered when a step ran out of memory), None meaning no bound.

    A run that sets no bounds (`current` None) keeps none: whether steps compute in
    micro-batches is the run's choice, made before its steps are traced.

    Example:
        >>> resumed_limits((None, 12, None), (None, 4, 8))
        (None, 4, 8)
    """
    if current is None or saved is None or len(saved) != len(current):
        return current
    return tuple(b if a is None else a if b is None else min(int(a), int(b))
                 for a, b in zip(current, saved))
