"""Per-replica compute time: the accumulators; the values read are `ReplicaTimes`.

Each training step, every replica records the time from the start of its step to its local
gradients being ready, before the gradient all-reduce: the time it would take alone, which
synchronous training hides behind the slowest replica. Where the step starts:
- one host (`from_release=False`): when the replica's inputs are there. The work between
  steps (Keras's loop, the update dispatch) is the host's, shared by all its replicas, so it is
  no replica's own cost;
- several workers (`from_release=True`): when the previous step's all-reduce released the
  replica, so each worker's own per-step work outside the forward and backward pass counts too
  (Keras's step overhead, the optimizer update, the input fetch: on a throttled machine these
  are throttled as well), while the time it waited for slower workers does not. The first step
  after `reset_clock()` (each new input pipeline, each epoch) starts at its inputs instead.
Times, actual sample counts and step counts accumulate on each replica's device in one ON_READ
variable; Python reads them between steps (`HeteroMirroredStrategy.read_replica_times`). The
stamps and the record are side ops: no part of the step waits for them.
"""

import tensorflow as tf

from tf_hetbatch.core.measurements import ReplicaTimes


class TimingAccumulators:
    """The three ON_READ SUM variables (seconds, samples, steps) of one strategy."""

    def __init__(self, strategy, num_local_replicas, from_release=False):
        self._strategy = strategy
        self._num_local = num_local_replicas
        self.from_release = from_release
        with strategy.scope():
            # One vector per replica: (compute seconds, samples, steps), one add per step.
            self._totals = tf.Variable(
                tf.zeros([3], tf.float64),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
                name="hetbatch_replica_totals",
            )
            # When the last gradient all-reduce released each replica (0: not yet).
            self._release = tf.Variable(
                tf.zeros([], tf.float64),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="hetbatch_release_time",
            )

    def step_start(self, inputs_ready):
        """Replica context: the step's start, the previous release if there is one."""
        if not self.from_release:
            return inputs_ready
        previous = self._release.read_value()
        return tf.where(previous > 0, previous, inputs_ready)

    def record_release(self, reduced):
        """Replica context: stamps the release once the all-reduced gradients are there."""
        if not self.from_release:
            return reduced
        ready = [t for t in tf.nest.flatten(reduced, expand_composites=True) if t is not None]
        with tf.control_dependencies(ready):
            now = tf.timestamp()
        # Nothing waits for the record (a stateful op the step runs anyway): the update
        # after the all-reduce gets no extra barrier.
        self._release.assign(now)
        return reduced

    def reset_clock(self):
        """Eager: the next step of each replica starts when its inputs are ready."""
        for local in self._strategy.experimental_local_results(self._release):
            local.assign(0.0)

    def record(self, seconds, samples):
        """In replica context: adds one step of this replica."""
        return self._totals.assign_add(
            tf.stack(
                [
                    tf.cast(seconds, tf.float64),
                    tf.cast(samples, tf.float64),
                    tf.constant(1.0, tf.float64),
                ]
            )
        )

    def read_local(self) -> ReplicaTimes:
        """Eagerly reads this process's replicas, in local replica order."""
        return ReplicaTimes.from_rows(
            [v.numpy() for v in self._strategy.experimental_local_results(self._totals)]
        )

    def subtract_local(self, times: ReplicaTimes):
        """Removes what was read, keeping anything recorded since (a step may be in flight)."""
        locals_ = self._strategy.experimental_local_results(self._totals)
        for local, row in zip(locals_, times.rows()):
            local.assign_sub(row)
