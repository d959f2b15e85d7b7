"""The gradient noise scale, measured from the step's own split, in the step's one all-reduce.

Replica k's mean gradient g_k over its b_k samples has E|g_k|^2 = |G|^2 + tr(S) / b_k (G the
true gradient, S the covariance of one sample's gradient), and the step's gradient g over all
B = sum b_k samples has E|g|^2 = |G|^2 + tr(S) / B. So the K + 1 points (1 / b_k, |g_k|^2) and
(1 / B, |g|^2) of one step scatter around the line |G|^2 + tr(S) x, and the least-squares line
through them is an unbiased estimate of both: its coefficients are linear in the squared norms,
with weights that depend on the batch sizes only. An uneven split gives K + 1 batch sizes, an
even one two (B / K and B), which is the two-batch estimator of McCandlish et al. (2018, "An
Empirical Model of Large-Batch Training"). A replica with no samples is no point; a step with
one replica (every point at 1 / B) measures nothing.

Smoothed as McCandlish et al. and Pollux smooth theirs (a single step's |G|^2 estimate can be
negative), by exponential moving averages over steps: of each point's squared norm and of its
1 / batch size (each counted where the point has samples, with that count's own average), so
each averaged point still lies on the line in expectation, also across a change of split, and
the line is fitted to the averaged points when read (`GradientNoise.from_points`); at a fixed
split that is the average of the steps' fits. The averages' start at 0 cancels in the ratios.

Each replica adds the squared norm of its weighted gradient and its samples b_k as a [K, 2]
float32 table, zero except its row, to the step's all-reduce, as the timing table (`timing`)
travels. After it, the first replica of each process makes the points (a replica's mean
gradient is its weighted one divided by its share b_k / B, the weight of a loss averaged over
samples, `weighting`; a loss with another denominator, a mask or sample weights, is measured per
sample all the same), the global one from the summed gradients, and moves the averages in its
copy of one ON_READ float64 variable: the same on every worker. Python reads that copy between
steps: no collective. A step's cost: one op per gradient tensor per replica, once more for the
global gradient, and some 25 small ops per process.

Off unless `measure_gradient_noise` was called: a step traced without it has none of this.
"""

import tensorflow as tf

from tf_hetbatch.core.gradient_noise import GradientNoise

# The state's columns, per point (each replica's, then the global one): moving averages of the
# point's squared norm and of 1 / its batch size, each times 1 where the point has samples, and
# of that 1; the steps recorded.
_COLUMNS = 4


class NoiseAccumulators:
    """The noise-scale state of one strategy (see the module docstring)."""

    def __init__(self, strategy, smoothing: float):
        self._strategy = strategy
        self.smoothing = smoothing
        self._num_replicas = strategy.num_replicas_in_sync
        replicas = strategy._topology.replica_range  # (first, count) across workers; None: all
        self._first_local = replicas[0] if replicas else 0
        with strategy.scope():
            self._state = tf.Variable(
                tf.zeros([self._num_replicas + 1, _COLUMNS], tf.float64), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="hetbatch_gradient_noise")

    def row(self, grads, samples) -> tf.Tensor:
        """Replica context: this replica's [K, 2] float32 table (zero except its row): the
        squared norm of its weighted gradient and its samples (the step's, not a
        micro-batch's: the gradients are the sum of its micro-batches'). Its point is made
        from the summed table (`record`): the work per replica is one op per gradient."""
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        slot = tf.one_hot(replica, self._num_replicas, dtype=tf.float32)
        return slot[:, None] * tf.stack([_squared_norm(grads), tf.cast(samples, tf.float32)])

    def record(self, summed_rows, summed_grads, applied=None):
        """Replica context: moves the averages by the step's points, the replicas' from the
        summed table and the global one from the summed gradients (a step whose update is not
        `applied`, because another worker ran out of memory, leaves them). Only the first
        replica of this process records: reads take its copy (ONLY_FIRST_REPLICA)."""
        replica = tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group)
        if replica is not None and replica != self._first_local:
            return None
        rows = tf.cast(summed_rows, tf.float64)
        squared, samples = rows[:, 0], rows[:, 1]
        total = tf.maximum(tf.reduce_sum(samples), 1.0)
        has = samples > 0
        safe = tf.where(has, samples, 1.0)
        present = tf.cast(has, tf.float64)
        # A replica's mean gradient is its weighted one divided by its share b_k / B.
        points = tf.stack([squared * tf.square(total / safe) * present, present / safe,
                           present, tf.ones_like(present)], 1)
        step_global = tf.stack([tf.cast(_squared_norm(summed_grads), tf.float64),
                                1.0 / total, 1.0, 1.0])
        points = tf.concat([points, step_global[None, :]], 0)
        beta = tf.constant([self.smoothing] * 3 + [1.0], tf.float64)
        gain = tf.constant([1.0 - self.smoothing] * 3 + [1.0], tf.float64)
        if applied is not None:
            gain *= tf.cast(applied, tf.float64)
            beta = tf.where(tf.cast(applied, tf.bool), beta, 1.0)
        return self._state.assign(self._state.read_value() * beta + points * gain)

    def read(self) -> GradientNoise:
        """Eagerly: this process's copy (no collective)."""
        state = self._strategy.experimental_local_results(self._state)[0].numpy()
        return GradientNoise.from_points(state[:, 0], state[:, 1], state[:, 2],
                                         int(state[0, 3]))


def _squared_norm(grads) -> tf.Tensor:
    """The squared norm of a list of gradients (float32 scalar): one op a tensor."""
    return 2.0 * tf.add_n([tf.cast(tf.nn.l2_loss(g), tf.float32)
                           for g in (tf.convert_to_tensor(g) for g in grads if g is not None)])
