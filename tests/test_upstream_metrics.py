"""Canaries of `_upstream.metrics`: Keras's metric variables under a strategy, and the global
logs computed from their sums.

When one fails after an upgrade, read `tf_hetbatch/distribute/_upstream/metrics.py`: the logs
(History, per-batch logs) may be read wrongly, or no longer in one collective.
"""

import keras
import pytest
import tensorflow as tf

from tf_hetbatch.distribute._upstream import metrics
from helpers import stock_mirrored


def _update_in_replicas(strategy, metric, scales):
    """Replica r updates `metric` with scale * (r + 1), once per scale."""
    @tf.function
    def update(values):
        strategy.run(metric.update_state, args=(values,))

    for scale in scales:
        update(strategy.experimental_distribute_values_from_function(
            lambda ctx, s=scale: tf.constant([s * (ctx.replica_id_in_sync_group + 1)])))


def test_keras_metric_variables_hold_each_replicas_own_sums(cpus):
    """`metrics.summable_metric_variables`, `metric_results_from_sums`: each replica's metric
    variables hold that replica's own running sums (SUM-on-read), so their sum across the
    replicas is the global state, and the results from those sums are Keras's own `result()`.
    Keras < 3.10 made them mirrored SUM-on-write variables (keras-team/keras#21061): every
    `assign_add` added the other replicas' previous totals again, and every log after a run's
    first step was wrong while the weights were right."""
    strategy = stock_mirrored(cpus[:2])
    with strategy.scope():
        metric = keras.metrics.Mean(name="m")
    _update_in_replicas(strategy, metric, (1.0, 10.0))  # replica 0: 1 + 10, replica 1: 2 + 20
    distributed = [v._value for v in metric.variables]
    assert all(d.synchronization == tf.VariableSynchronization.ON_READ
               and d.aggregation == tf.VariableAggregation.SUM for d in distributed)
    local = [[float(t) for t in strategy.experimental_local_results(d)] for d in distributed]
    assert local == [[11.0, 22.0], [2.0, 2.0]]  # total and count, each replica's own
    assert metrics.summable_metric_variables([metric]) == distributed
    sums = [sum(values) for values in local]
    assert float(metrics.metric_results_from_sums([metric], sums)["m"]) == pytest.approx(8.25)
    assert float(metric.result()) == pytest.approx(8.25)  # Keras's own read sums them too


class _OnWriteSum(keras.metrics.Metric):
    """A metric with a mirrored SUM-on-write variable, as Keras < 3.10 made every one."""

    def __init__(self):
        super().__init__(name="on_write")
        self.total = keras.Variable(0.0, trainable=False, aggregation="sum",
                                    synchronization="on_write", name="total")

    def update_state(self, values):
        self.total.assign_add(tf.reduce_sum(values))

    def result(self):
        return tf.convert_to_tensor(self.total.value)


def test_a_metric_variable_that_is_not_sum_on_read_is_left_to_keras(cpus):
    """`metrics.summable_metric_variables` takes only SUM-on-read variables: a mirrored SUM
    variable is not per replica (summing it across replicas would count it K times), so the
    logs are then read as Keras reads them (`metric_results_of` gives None)."""
    strategy = stock_mirrored(cpus[:2])
    with strategy.scope():
        mean, on_write = keras.metrics.Mean(name="m"), _OnWriteSum()
    _update_in_replicas(strategy, on_write, (1.0, 10.0))  # updates 1 + 2, then 10 + 20
    assert on_write.total._value.synchronization == tf.VariableSynchronization.ON_WRITE
    assert on_write.total._value.aggregation == tf.VariableAggregation.SUM
    # Keras's `assign_add` is `assign(self + value)`, and a SUM-on-write assign sums the
    # replicas' values: K * old + the updates, 2 * 3 + 30, not 33 (what made every log of
    # Keras < 3.10 drift after the first step).
    assert float(on_write.result()) == 36.0
    assert metrics.summable_metric_variables([mean]) is not None
    assert metrics.summable_metric_variables([mean, on_write]) is None
    assert metrics.metric_results_of(strategy, [mean, on_write]) is None

