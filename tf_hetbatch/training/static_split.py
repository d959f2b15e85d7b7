"""The static split of `DynamicBatching`: the split a `fit` starts from.

`initial` chooses it: in proportion to each part's nominal peak FLOP/s ("flops"), to the
throughputs measured over a first window on the even split ("probe"), the even split
("uniform"), or sizes given. When the global batch B is not known at the start (data of
unknown batch size), the split waits for the first window, which gives B as the measured
samples per step. The controller then starts from this split.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from tf_hetbatch.core import split as _split
from tf_hetbatch.core._validate import format_value
from tf_hetbatch.core.bounds import Bounds
from tf_hetbatch.core.protocols import SplitStrategy

logger = logging.getLogger(__name__)

__all__ = ["INITIAL_MODES", "check_initial", "device_capacities", "StaticSplitPolicy"]

INITIAL_MODES = ("flops", "probe", "uniform")

Initial = Union[str, Tuple[int, ...]]
Sizes = Tuple[int, ...]


def check_initial(initial: Union[str, Sequence[int]]) -> Initial:
    """Checks `DynamicBatching(initial=...)`: a mode of `INITIAL_MODES`, or a non-empty list
    of sizes >= 0 summing to at least 1 (returned as a tuple of ints).

    Raises:
        ValueError: an unknown mode or bad sizes.
        TypeError: neither a mode nor a list.
    """
    if isinstance(initial, str):
        if initial not in INITIAL_MODES:
            raise ValueError(
                f"`initial` must be one of {INITIAL_MODES} or a list of per-replica batch "
                f"sizes. Received: initial={initial!r}")
        return initial
    if isinstance(initial, bytes) or np.ndim(initial) != 1 or len(initial) == 0:
        raise TypeError(
            f"`initial` must be one of {INITIAL_MODES} or a list of per-replica batch sizes, "
            f"e.g. [48, 16]. Received: initial={format_value(initial)}")
    sizes = _split.validate_sizes(initial, len(initial))
    if sum(sizes) < 1:
        raise ValueError(f"`initial` sizes must sum to the global batch size (>= 1). "
                         f"Received: initial={list(sizes)}")
    return sizes


def device_capacities(strategy: SplitStrategy) -> np.ndarray:
    """Nominal peak FLOP/s of every part's device, in part order (`strategy.part_capacities`).

    Synchronous strategies look up each replica's device (`tf_hetbatch.distribute.device_peaks`) and
    gather them: in multi-worker training a collective, to call on every worker.
    `HeteroParameterServerStrategy` reads each worker's CPU on the worker.

    Args:
        strategy: a tf_hetbatch strategy.

    Returns:
        float64 array [strategy.num_parts] of FLOP/s.
    """
    return np.asarray(strategy.part_capacities(), np.float64)


class StaticSplitPolicy:
    """The static split of one `fit`, for `initial` and the bounds in force.

    Args:
        initial: a checked `initial` (`check_initial`).
        probe_steps: the probe's window length (steps).
        bounds: (min_sizes, max_sizes) the split must respect.
    """

    def __init__(self, initial: Initial, probe_steps: int, bounds: Tuple[Bounds, Bounds]):
        self.initial = initial
        self.probe_steps = probe_steps
        self._lo, self._hi = bounds
        self._capacities: Optional[np.ndarray] = None

    def first_window_length(self, interval: int) -> int:
        """Steps of the window that ends the static split: the probe's, else `interval`."""
        return self.probe_steps if self.initial == "probe" else interval

    def at_start(self, strategy: SplitStrategy) -> Optional[Tuple[Sizes, Optional[str]]]:
        """What to apply when `fit` starts; call it on every worker alike.

        Returns:
            `(sizes, reason)`: the static split and why; `(sizes, None)`: a split to measure
            on first (the probe's even split), not yet the static split; None: the global
            batch is not known yet, so the split waits for the first window
            (`from_window`).

        Raises:
            ValueError: given sizes of another count than the strategy's parts; a GPU that
                TensorFlow does not list (with "flops").
        """
        num = strategy.num_parts
        if not isinstance(self.initial, str) and len(self.initial) != num:
            raise ValueError(
                f"`initial` must have one batch size per replica ({num}). Received: "
                f"initial={list(self.initial)}. Fix: give {num} sizes, or initial='flops'.")
        if self.initial == "flops":
            # A collective in multi-worker training: called on every worker, B known or not.
            self._capacities = device_capacities(strategy)
        total = strategy.global_batch_size
        if not isinstance(self.initial, str):
            return self.initial, "initial split: given sizes"
        if total is None:
            return None
        if self.initial == "probe":
            return _split.split_evenly(total, num), None
        return self._split(total, num), self._reason()

    def from_window(self, total: int, num: int, throughput: np.ndarray) -> Tuple[Sizes, str]:
        """The static split once the first window was measured: `(sizes, reason)`.

        Args:
            total: the global batch (as measured, if it was unknown).
            num: the number of parts.
            throughput: the window's samples per compute second of each part (NaN: not
                measured), which the probe splits in proportion to.
        """
        if self.initial != "probe":
            return self._split(total, num), self._reason()
        throughput = np.nan_to_num(throughput, nan=0.0)
        if not np.any(throughput > 0):  # e.g. steps compiled by XLA, which are not timed
            return self._split(total, num, np.ones(num)), "initial split: uniform (the probe " \
                "measured no replica)"
        rates = ", ".join(f"{x:.0f}" for x in throughput)
        return (self._split(total, num, throughput),
                f"initial split: proportional to probed samples/s [{rates}]")

    def _reason(self) -> str:
        if self.initial == "flops":
            peaks = ", ".join(f"{c / 1e9:.0f}" for c in self._capacities)
            return f"initial split: proportional to nominal peak GFLOP/s [{peaks}]"
        return "initial split: uniform"

    def _split(self, total, num, throughputs=None) -> Sizes:
        if self.initial == "flops":
            weights = self._capacities
        elif throughputs is not None:
            weights = throughputs
        else:
            weights = np.ones(num)
        return _split.split_proportionally(total, weights, self._lo, self._hi)
