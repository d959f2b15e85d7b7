"""What the strategies measure, as plain values (numpy only, no TensorFlow import).

- `ReplicaTimes`: per replica (or, in asynchronous training, per worker) the accumulated
  compute seconds, samples and steps: what `read_replica_times` returns and the controllers
  turn into throughputs. How the time is taken is in `tf_hetbatch.distribute.timing`.
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
    """Accumulated per-replica compute measurements, in replica order.

    Attributes:
        compute_seconds: float64 [K], summed compute time of each replica.
        samples: float64 [K], summed actual samples each replica processed.
        steps: float64 [K], training steps each replica ran.
    """

    compute_seconds: np.ndarray
    samples: np.ndarray
    steps: np.ndarray

    @classmethod
    def from_rows(cls, rows) -> "ReplicaTimes":
        """From a [K, 3] array of (compute seconds, samples, steps) rows."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
        return cls(rows[:, 0], rows[:, 1], rows[:, 2])

    def rows(self) -> np.ndarray:
        """float64 [K, 3]: (compute seconds, samples, steps) per replica."""
        return np.stack([self.compute_seconds, self.samples, self.steps], axis=1)

    @property
    def num_replicas(self) -> int:
        return int(self.compute_seconds.shape[0])

    @property
    def time_per_step(self) -> np.ndarray:
        """Mean compute seconds per step of each replica (NaN where no step ran)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.steps > 0, self.compute_seconds / self.steps, np.nan)

    @property
    def samples_per_step(self) -> np.ndarray:
        """Mean samples per step of each replica (NaN where no step ran)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.steps > 0, self.samples / self.steps, np.nan)

    @property
    def throughput(self) -> np.ndarray:
        """Samples per compute second of each replica (NaN where nothing was timed)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(
                self.compute_seconds > 0, self.samples / self.compute_seconds, np.nan
            )

    def __sub__(self, other: "ReplicaTimes") -> "ReplicaTimes":
        return ReplicaTimes(
            self.compute_seconds - other.compute_seconds,
            self.samples - other.samples,
            self.steps - other.steps,
        )



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
    return bool(np.allclose(samples_per_step, split, rtol=ROUNDING, atol=ROUNDING))


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
