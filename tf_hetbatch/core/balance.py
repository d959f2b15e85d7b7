"""The balance of one measurement window: per-replica throughputs, waits and efficiency.

Pure arithmetic on a window's per-replica means (no TensorFlow): what the balance dashboards
(`dashboards.summaries.BalanceWriter`) draw, and the step time of a perfectly balanced split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from tf_hetbatch.core import split as _split

__all__ = ["BalanceWindow"]


@dataclasses.dataclass(frozen=True)
class BalanceWindow:
    """Per-replica measurements of one window and the quantities derived from them.

    Attributes:
      step: Global step at the end of the window.
      batch_sizes: Mean samples/step per replica.
      compute_times: Mean seconds/step per replica, from the step's start to local gradients.
      step_time: Mean wall seconds/step of the whole synchronous step.
      ideal_step_time: Seconds/step of a perfectly balanced split, or None if unknown.
    """

    step: int
    batch_sizes: Tuple[float, ...]
    compute_times: Tuple[float, ...]
    step_time: float
    ideal_step_time: Optional[float]

    @property
    def measured(self) -> Tuple[bool, ...]:
        """Per replica: False if it had samples but no compute time (not measured).

        A replica's time can be 0 when its step's compute took less than the clock's
        resolution (1 us), or when it finished no step in the window; its batch size is still
        known and drawn, its time, throughput and wait are not.
        """
        return tuple(t > 0 or b == 0 for b, t in zip(self.batch_sizes, self.compute_times))

    @property
    def throughputs(self) -> Tuple[float, ...]:
        """Samples/s per replica, b_k / t_k (0 for a replica with no samples, NaN unmeasured)."""
        return tuple(b / t if t > 0 else (0.0 if m else math.nan)
                     for b, t, m in zip(self.batch_sizes, self.compute_times, self.measured))

    @property
    def wait_times(self) -> Tuple[float, ...]:
        """Seconds/step each replica waits for the slowest one, max(t) - t_k (NaN unmeasured)."""
        slowest = max(self.compute_times)
        return tuple(slowest - t if m else math.nan
                     for t, m in zip(self.compute_times, self.measured))

    @property
    def balance_efficiency(self) -> float:
        """mean(t) / max(t): 1.0 when every replica finishes at once (1.0 if all t are 0).

        NaN when a replica with samples was not measured.
        """
        if not all(self.measured):
            return math.nan
        slowest = max(self.compute_times)
        if slowest <= 0:
            return 1.0
        return sum(self.compute_times) / len(self.compute_times) / slowest

    @property
    def global_batch(self) -> float:
        """sum(b_k), samples per synchronous step."""
        return float(sum(self.batch_sizes))

    @property
    def throughput(self) -> float:
        """Aggregate samples/s, sum(b_k) / step_time."""
        return self.global_batch / self.step_time

    def balanced_step_time(self) -> Optional[float]:
        """Step time if the split were proportional to the measured throughputs.

        With throughputs X_k = b_k / t_k unchanged, the balanced compute time is the level
        of the equal-finish split of B (`split.equal_finish_level`), B / sum(X_k); the
        measured non-compute part of the step, step_time - max(t_k) (all-reduce, input,
        overhead), is added unchanged.

        Returns:
          Seconds per step, or None when a replica with samples was not measured.
        """
        if not all(self.measured):
            return None
        throughputs = self.throughputs
        if sum(throughputs) <= 0:
            return self.step_time
        overhead = max(0.0, self.step_time - max(self.compute_times))
        level, _ = _split.equal_finish_level(self.global_batch, [0.0] * len(throughputs),
                                             throughputs)
        return level + overhead
