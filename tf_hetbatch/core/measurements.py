"""What the strategies measure, as plain values (numpy only, no TensorFlow import).

- `ReplicaTimes`: per replica (or, in asynchronous training, per worker) the accumulated
  compute seconds, samples and steps (and, in synchronous training, step cycles): what
  `read_replica_times` returns and the controllers turn into throughputs and step times. How the time is taken is in `tf_hetbatch.distribute.timing`.
- `Staleness`: per worker of asynchronous training, a histogram of how stale its updates were
  (`HeteroParameterServerStrategy.read_staleness`).
- `at_split`, `straddles_switch`: the one rule for a measurement window around a switch of
  split (`DynamicBatching`, the simulator and the controllers use it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch.core._stats import ROUNDING

__all__ = ["ReplicaTimes", "Staleness", "at_split", "straddles_switch"]


@dataclasses.dataclass(frozen=True)
class ReplicaTimes:
    """Accumulated per-replica measurements, in replica order.

    Attributes:
        compute_seconds: float64 [K], summed compute time of each replica.
        samples: float64 [K], summed actual samples each replica processed.
        steps: float64 [K], training steps each replica ran.
        cycle_seconds: float64 [K], summed wall seconds of each replica's step cycles: from
            one release by the step's all-reduce to the next (its input, compute, the wait for
            slower replicas, the all-reduce and the host's work between steps). Zeros where
            the strategy does not measure cycles (asynchronous training).
        cycles: float64 [K], the cycles summed (a step after a pause starts none).
        timed_steps: float64 [K], the steps whose compute time `compute_seconds` holds: all
            but the first step at each new shape of the replica's batch (which builds what
            that shape needs: `tf_hetbatch.distribute.timing`). Default: `steps`.
    """

    compute_seconds: np.ndarray
    samples: np.ndarray
    steps: np.ndarray
    cycle_seconds: Optional[np.ndarray] = None
    cycles: Optional[np.ndarray] = None
    timed_steps: Optional[np.ndarray] = None

    def __post_init__(self):
        for name in ("cycle_seconds", "cycles"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros_like(self.compute_seconds))
        if self.timed_steps is None:
            object.__setattr__(self, "timed_steps", np.array(self.steps, dtype=np.float64))

    @classmethod
    def from_rows(cls, rows) -> "ReplicaTimes":
        """From a [K, 3] array of (compute seconds, samples, steps) rows, or a [K, 5] one
        with (cycle seconds, cycles) after them, or a [K, 6] one with timed steps last."""
        rows = np.asarray(rows, dtype=np.float64)
        width = rows.shape[1] if rows.ndim == 2 and rows.shape[1] in (5, 6) else 3
        rows = rows.reshape(-1, width)
        return cls(*(rows[:, i] for i in range(width)))

    def rows(self) -> np.ndarray:
        """float64 [K, 6]: (compute seconds, samples, steps, cycle seconds, cycles, timed
        steps) per replica."""
        return np.stack([self.compute_seconds, self.samples, self.steps, self.cycle_seconds,
                         self.cycles, self.timed_steps], axis=1)

    @property
    def num_replicas(self) -> int:
        return int(self.compute_seconds.shape[0])

    @property
    def time_per_step(self) -> np.ndarray:
        """Mean compute seconds per timed step of each replica (NaN where none was timed)."""
        return _mean(self.compute_seconds, self.timed_steps)

    @property
    def samples_per_step(self) -> np.ndarray:
        """Mean samples per step of each replica (NaN where no step ran)."""
        return _mean(self.samples, self.steps)

    @property
    def throughput(self) -> np.ndarray:
        """Samples per compute second of each replica (NaN where nothing was timed)."""
        return _mean(self.samples_per_step, self.time_per_step)

    @property
    def cycle_time(self) -> np.ndarray:
        """Mean wall seconds per step cycle of each replica (NaN where none was measured)."""
        return _mean(self.cycle_seconds, self.cycles)

    @property
    def step_time(self) -> Optional[float]:
        """The cluster's mean step time: the longest replica's mean cycle; None where no cycle
        was measured. In synchronous training every worker reads the same value (the cycles
        travel in the step's all-reduce)."""
        measured = self.cycle_time[self.cycles > 0]
        return float(np.max(measured)) if measured.size else None

    def __sub__(self, other: "ReplicaTimes") -> "ReplicaTimes":
        return ReplicaTimes.from_rows(self.rows() - other.rows())


def _mean(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


@dataclasses.dataclass(frozen=True)
class Staleness:
    """Staleness of the updates of each worker: global updates between its read and its update.

    Attributes:
        histogram: int64 [K, bins]: ``histogram[k, s]`` counts worker k's updates that were
            s updates stale; the last bin counts ``bins - 1`` or more.
    """

    histogram: np.ndarray

    @property
    def updates(self) -> np.ndarray:
        """Updates counted per worker."""
        return self.histogram.sum(axis=1)

    @property
    def mean(self) -> np.ndarray:
        """Mean staleness per worker (NaN for a worker without updates; the last bin counts
        as its lower bound)."""
        bins = np.arange(self.histogram.shape[1])
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.updates > 0, self.histogram @ bins / self.updates, np.nan)

    @property
    def max(self) -> np.ndarray:
        """Largest staleness seen per worker (-1 for a worker without updates)."""
        seen = self.histogram > 0
        last = self.histogram.shape[1] - 1 - np.argmax(seen[:, ::-1], axis=1)
        return np.where(seen.any(axis=1), last, -1)

    def overall(self) -> np.ndarray:
        """Histogram over all workers, int64 [bins]."""
        return self.histogram.sum(axis=0)

    def __sub__(self, other: "Staleness") -> "Staleness":
        return Staleness(self.histogram - other.histogram)


def at_split(samples_per_step: ArrayLike, split: ArrayLike) -> bool:
    """Whether a window's mean samples per step of every replica are those of `split` (up to
    the rounding of the sums): the window ran at that split only.

    Example:
        >>> at_split([48.0, 16.0], (48, 16)), at_split([40.0, 24.0], (48, 16))
        (True, False)
    """
    # np.allclose's test, |a - b| <= atol + rtol * |b| for every replica, without its
    # per-call overhead (a controller checks this every window).
    a = np.asarray(samples_per_step, np.float64)
    b = np.asarray(split, np.float64)
    return bool((np.abs(a - b) <= ROUNDING + ROUNDING * np.abs(b)).all())


def straddles_switch(samples_per_step: ArrayLike, split: ArrayLike, window_start: int,
                     switched_at: Optional[int], switch_lag: int) -> bool:
    """Whether a measurement window may mix the split before a switch and `split` after it.

    A switch decided before step `switched_at` is surely in force from step
    `switched_at + switch_lag` (the input pipeline runs ahead). A window that started before
    that and whose samples per step are not `split`'s straddles the switch: its step time
    mixes two splits, so it is not fed to a controller. A window that does not straddle ends
    the watch (the caller forgets `switched_at`): the split is in force from then on.

    Args:
        samples_per_step: the window's mean samples per step of every replica.
        split: the split decided last.
        window_start: the window's first step.
        switched_at: the first step after the last switch was decided, None if none is
            watched.
        switch_lag: steps until a switch is surely in force (`switch_lag_steps`).
    """
    return switched_at is not None and window_start < switched_at + switch_lag and not \
        at_split(samples_per_step, split)
