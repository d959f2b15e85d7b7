"""The window clock of a `Balancer`: which steps are measured, and what.

A window clock per `fit`: the first `warmup_steps` steps (tracing; in asynchronous training also
until every worker finished 2 updates) are not measured; then each window counts training steps
(several per call: Keras's `steps_per_execution`, or a loop that reports only when `steps_due`
says) and ends at the first call at least `length` steps after it started. At its end the
strategy's per-part measurements over the window are read: in synchronous training with the
cluster's mean step time (one process holding every replica: its own wall clock; several workers:
the cycles carried in the steps' all-reduce, `ReplicaTimes.step_time`, so every worker reads the
same value without a collective); in asynchronous training with the workers' staleness.

Multi-worker: the clock counts steps, which are the same on every worker, so every worker
starts and ends each window at the same step and reads the same measurements.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import numpy as np

from tf_hetbatch.core.measurements import ReplicaTimes
from tf_hetbatch.core.protocols import SplitStrategy

__all__ = ["ASYNC_WARM_UPDATES", "WindowMeasurement", "WindowClock"]

# Asynchronous training: a worker's first updates of a fit include its tracing and input
# start-up; measuring starts once every worker finished this many.
ASYNC_WARM_UPDATES = 2


@dataclasses.dataclass(frozen=True)
class WindowMeasurement:
    """What one window measured.

    Attributes:
        steps: training steps in the window.
        times: the strategy's per-part measurements over the window.
        step_time: this process's mean wall seconds per step: the wall time from each
            call (or `batch_begin`) to the next, over the window's steps.
        cluster_step_time: synchronous training: the cluster's mean step, the same on every
            worker (one process: `step_time`; several: `ReplicaTimes.step_time`); None in
            asynchronous training, or where no cycle was measured.
        staleness: asynchronous training: the staleness of the window's updates
            (`Staleness`); None in synchronous training.
    """

    steps: int
    times: ReplicaTimes
    step_time: float
    cluster_step_time: Optional[float]
    staleness: Optional[Any]


class WindowClock:
    """The window clock of one fit, fed by the loop's calls (`batch_end`).

    Args:
        strategy: the fit's tf_hetbatch strategy.
        warmup_steps: steps at the start of the fit left unmeasured.
    """

    def __init__(self, strategy: SplitStrategy, warmup_steps: int):
        self._strategy = strategy
        self._warmup_steps = warmup_steps
        self._warm_base = strategy.read_totals() if strategy.asynchronous else None
        self._fit_step = 0
        self._steps = 0
        self._wall = 0.0
        self._batch_start = 0.0
        self._measuring = False

    def begin(self) -> None:
        """After the static split is applied: without a warm-up the first window starts now
        (a local read: no collective)."""
        if self._warmup_steps == 0 and self._warm_base is None:
            self._start()

    @property
    def fit_step(self) -> int:
        """Steps reported since the clock was made (this fit's)."""
        return self._fit_step

    def steps_due(self, length: int) -> int:
        """Steps (>= 1) until the next call that can start or end a window (windows of
        `length` steps); a call before then only counts steps. Asynchronous training: 1 (its
        warm-up waits for every worker's updates, which only a call can see)."""
        if self._measuring:
            return max(length - self._steps, 1)
        if self._warm_base is not None:
            return 1
        return max(self._warmup_steps - self._fit_step, 1)

    def batch_begin(self) -> None:
        """Stamps the start of the next call's steps (after a pause that is no step's)."""
        self._batch_start = time.perf_counter()

    def batch_end(self, steps: int, length: int) -> Optional[WindowMeasurement]:
        """`on_train_batch_end` of a call that ran `steps` steps: the measurement of the
        window this call ends (at least `length` steps), else None."""
        wall = time.perf_counter() - self._batch_start
        self._fit_step += steps
        if not self._measuring:
            if self._fit_step >= self._warmup_steps and self._workers_warm():
                self._start()
            return None
        self._steps += steps
        self._wall += wall
        if self._steps < length:
            return None
        return self._end()

    def _workers_warm(self) -> bool:
        if self._warm_base is None:
            return True
        done = self._strategy.read_totals().steps - self._warm_base.steps
        return bool(np.min(done) >= ASYNC_WARM_UPDATES)

    def _start(self) -> None:
        # Drops what the warm-up steps accumulated (the same step on every worker).
        self._strategy.read_replica_times(reset=True)
        if self._strategy.asynchronous:
            self._strategy.read_staleness(reset=True)
        self._measuring = True
        self._steps = 0
        self._wall = 0.0

    def _end(self) -> WindowMeasurement:
        strategy = self._strategy
        steps = self._steps
        step_time = self._wall / steps
        self._steps = 0
        self._wall = 0.0
        times = strategy.read_replica_times(reset=True)
        if strategy.asynchronous:
            return WindowMeasurement(steps, times, step_time, None,
                                     strategy.read_staleness(reset=True))
        # One process holding every replica reads the step on its own clock (the release
        # stamps of replicas sharing its cores run late, by varying amounts); across processes
        # every worker needs the same value: the cycles the steps' all-reduce carried.
        one_process = strategy.num_local_replicas == strategy.num_parts
        return WindowMeasurement(steps, times, step_time,
                                 step_time if one_process else times.step_time, None)
