"""Per-replica compute time: accumulators and the values read from them.

Each training step, every replica records the time from the start of its step (its inputs
ready) to its local gradients being ready, before the gradient all-reduce: the time it would
take alone, which synchronous training hides behind the slowest replica. Times, actual sample
counts and step counts accumulate on each replica's device in ON_READ variables; Python reads
them between steps (`HeteroMirroredStrategy.read_replica_times`).
"""

import dataclasses

import numpy as np
import tensorflow as tf


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


class TimingAccumulators:
    """The three ON_READ SUM variables (seconds, samples, steps) of one strategy."""

    def __init__(self, strategy, num_local_replicas):
        self._strategy = strategy
        self._num_local = num_local_replicas
        with strategy.scope():
            self._vars = tuple(
                tf.Variable(
                    tf.zeros([], tf.float64),
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name=f"hetbatch_{name}",
                )
                for name in ("compute_seconds", "samples", "steps")
            )

    def record(self, seconds, samples):
        """In replica context: adds one step of this replica."""
        seconds_var, samples_var, steps_var = self._vars
        return tf.group(
            seconds_var.assign_add(tf.cast(seconds, tf.float64)),
            samples_var.assign_add(tf.cast(samples, tf.float64)),
            steps_var.assign_add(tf.constant(1.0, tf.float64)),
        )

    def read_local(self) -> ReplicaTimes:
        """Eagerly reads this process's replicas, in local replica order."""
        arrays = [
            np.array(
                [float(v.numpy()) for v in self._strategy.experimental_local_results(var)],
                dtype=np.float64,
            )
            for var in self._vars
        ]
        return ReplicaTimes(*arrays)

    def subtract_local(self, times: ReplicaTimes):
        """Removes what was read, keeping anything recorded since (a step may be in flight)."""
        for var, values in zip(self._vars, (times.compute_seconds, times.samples, times.steps)):
            for local, value in zip(self._strategy.experimental_local_results(var), values):
                local.assign_sub(value)
